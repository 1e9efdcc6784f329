"""A request's several prompts (or ``n`` choices) on a batching server run side by side on spare
generation slots, so the scheduler batches their passes; the results are those of running them
one after the other, and a request never takes a slot or KV bytes someone else could need."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

import specdec.server.openai_api as api
from specdec import defaults
from specdec.server import ServerSettings, create_app
from specdec.drafters import ModelDrafter
from tiny import tiny_native
from toy_server import ChatLetters, LetterTokenizer

PROMPTS = ["abc", "de", "fghi", "jk", "l", "mno"]
VOCAB = 26


def _app(model, draft, **settings):
    return TestClient(create_app(model, tokenizer=LetterTokenizer(), settings=ServerSettings(**settings),
                                 drafter_factory=lambda: ModelDrafter(draft), drafter_name="tiny"),
                      base_url="http://localhost")


@pytest.fixture
def running(monkeypatch):
    """The most choices that ran at once, over every request since the fixture started.

    With ``state["gather"] = k``, a choice that starts waits (up to 10 s) until k choices run, so
    a count of k does not hang on when each thread was scheduled: a loaded machine can start one
    choice's thread only after another has finished, which would read as fewer side by side. A
    server that never runs k at once still shows fewer (each waits out the 10 s, then runs)."""
    state = {"now": 0, "most": 0, "gather": None}
    changed = threading.Condition()
    run = api._Job.run

    def counting(self, *a, **k):
        with changed:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            changed.notify_all()
            if state["gather"]:
                changed.wait_for(lambda: state["now"] >= state["gather"], timeout=10)
        try:
            return run(self, *a, **k)
        finally:
            with changed:
                state["now"] -= 1
                changed.notify_all()

    monkeypatch.setattr(api._Job, "run", counting)
    return state


def _texts(client, prompts, **kw):
    r = client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 12, **kw})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == list(range(len(body["choices"])))
    return [c["text"] for c in body["choices"]], body


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}])
def test_choices_run_side_by_side_and_give_what_one_after_the_other_gives(running, sampling):
    model, draft = tiny_native(vocab=VOCAB), tiny_native(vocab=VOCAB, seed=1)
    side = _app(model, draft, max_active_requests=6)
    alone = _app(model, draft, batching=False)
    running["gather"] = 4
    got, body = _texts(side, PROMPTS, **sampling)
    assert running["most"] == 4  # the admitted slot and three spare ones: half of the six slots
    running["gather"] = None
    ctx = side.app.state.ctx
    assert ctx.store.claimed_bytes == 0 and ctx.active._value == 6 and ctx.spare._value == 3  # all given back
    running["most"] = 0
    ref, _ = _texts(alone, PROMPTS, **sampling)  # the serialised server runs them one after the other
    assert running["most"] == 1 and got == ref
    assert got == [_texts(alone, [p], **sampling)[0][0] for p in PROMPTS]  # each prompt alone (same seed)
    n2, _ = _texts(side, PROMPTS[:1], n=3, **sampling)
    assert n2[0] == got[0] and (len(set(n2)) == 1) == (sampling["temperature"] == 0)


def test_no_spare_slot_or_kv_room_means_one_after_the_other(running):
    model, draft = tiny_native(vocab=VOCAB), tiny_native(vocab=VOCAB, seed=1)
    one = _app(model, draft, max_active_requests=1)
    ref, _ = _texts(one, PROMPTS, temperature=0)
    assert running["most"] == 1
    probe = one.app.state.ctx
    positions = 4 + 12 + defaults.MAX_GAMMA + 1 + defaults.MAX_TREE_NODES  # as _Job sizes a choice's claim
    per_choice = int(1.5 * positions * (probe.kv_per_position + probe.draft_kv_per_position))  # one claim fits, two do not
    tight = _app(model, draft, max_kv_bytes=per_choice)
    got, _ = _texts(tight, PROMPTS, temperature=0)
    assert running["most"] == 1 and got == ref and tight.app.state.ctx.store.claimed_bytes == 0


def test_a_request_takes_at_most_its_share_of_spare_slots(running, monkeypatch):
    model, draft = tiny_native(vocab=VOCAB), tiny_native(vocab=VOCAB, seed=1)
    monkeypatch.setattr(defaults, "SERVER_CHOICES_SIDE_BY_SIDE", 2)
    capped = _app(model, draft, max_active_requests=16)
    running["gather"] = 2
    ref, _ = _texts(capped, PROMPTS, temperature=0)
    assert running["most"] == 2  # the per-request cap
    monkeypatch.setattr(defaults, "SERVER_CHOICES_SIDE_BY_SIDE", 16)
    running["most"] = 0
    two = _app(model, draft, max_active_requests=2)  # one spare slot at most: half of two
    assert _texts(two, PROMPTS, temperature=0)[0] == ref and running["most"] == 2


def _streamed(client, path, body):
    """(text per choice index, finish reason per index, usage, stats, indices in arrival order) of a streamed request."""
    import json

    r = client.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    order, usage, stats = [], None, None
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        assert "error" not in chunk, chunk
        usage = chunk.get("usage") or usage
        stats = chunk.get("specdec") or stats
        for c in chunk["choices"]:
            i = c["index"]
            piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
            texts[i] = texts.get(i, "") + (piece or "")
            order.append(i)
            if c.get("finish_reason"):
                finish[i] = c["finish_reason"]
    return texts, finish, usage, stats, order


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}])
def test_streamed_choices_run_side_by_side_and_stream_what_a_plain_request_returns(running, sampling):
    """A streamed request's prompts (and ``n`` choices) take spare slots as an unstreamed one's do;
    its chunks interleave, each with its index, and each choice streams the text, finish reason
    and, at the end, the usage the same request returns unstreamed."""
    model, draft = tiny_native(vocab=VOCAB), tiny_native(vocab=VOCAB, seed=1)
    side = _app(model, draft, max_active_requests=6)
    ref, body = _texts(side, PROMPTS, **sampling)
    running["most"], running["gather"] = 0, 4
    texts, finish, usage, stats, order = _streamed(side, "/v1/completions",
                                                   {"prompt": PROMPTS, "max_tokens": 12, "stream_options": {"include_usage": True},
                                                    **sampling})
    assert running["most"] == 4  # the admitted slot and three spare ones, as unstreamed
    running["gather"] = 3  # the chat request's three choices below
    assert [texts[i] for i in range(len(PROMPTS))] == ref
    assert finish == {i: c["finish_reason"] for i, c in enumerate(body["choices"])}
    assert usage == body["usage"] and stats["lossless"] is True and stats["target_calls"] >= len(PROMPTS)
    assert order != sorted(order)  # interleaved, not one choice after another
    ctx = side.app.state.ctx
    assert ctx.store.claimed_bytes == 0 and ctx.active._value == 6 and ctx.spare._value == 3  # all given back
    chat = TestClient(create_app(model, tokenizer=ChatLetters(), settings=ServerSettings(max_active_requests=6),
                                 drafter_factory=lambda: ModelDrafter(draft), drafter_name="tiny"), base_url="http://localhost")
    body = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 12, "n": 3, **sampling}
    r = chat.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    texts, finish, _, _, order = _streamed(chat, "/v1/chat/completions", body)
    assert [texts[i] for i in range(3)] == [c["message"]["content"] for c in r.json()["choices"]]
    assert order != sorted(order) and finish == {i: c["finish_reason"] for i, c in enumerate(r.json()["choices"])}
