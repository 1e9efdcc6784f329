"""The session store's bookkeeping, pinned directly on :class:`SessionStore` with stand-in sessions
(an owner, a lock, ``last_used``, a cache of a given size, a ``close``): no model, no server; then one
edge session's rounds on a toy model, in process.

Each test pins one promise of ``specdec/server/sessions.py``: what the TTL sweep reports and
hands over, which sessions eviction may take, how held KV bytes are counted, and what a round
checks, answers and leaves behind when it fails."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from specdec.errors import ModelError
from specdec.models.toy import ToyLM
from specdec.remote.protocol import CreateSessionRequest, VerifyRequest
from specdec.server import ServerSettings
from specdec.server.errors import ApiError
from specdec.server.sessions import SessionStore, create_session
from specdec.server import sessions as sessions_mod


def _session(sid: str, *, owner: str = "", nbytes: int = 0, idle_s: float = 0.0, closed: list | None = None):
    """A stand-in for an EdgeSession: what the store reads of one."""
    target = SimpleNamespace(cache=SimpleNamespace(nbytes=nbytes),
                             close=lambda: closed.append(sid) if closed is not None else None)
    return SimpleNamespace(id=sid, owner=owner, lock=threading.Lock(), last_used=time.monotonic() - idle_s,
                           target=target)


def _store(reasons: list | None = None, **settings) -> SessionStore:
    return SessionStore(ServerSettings(**settings), on_evict=(reasons.append if reasons is not None else None))


def test_the_sweep_names_ttl_as_the_reason_for_each_session_it_drops():
    """Every session dropped by the TTL sweep is reported to the metrics hook with reason "ttl"."""
    reasons: list[str] = []
    store = _store(reasons, session_ttl_s=60.0)
    closed: list[str] = []
    for sid in ("a", "b"):
        store.add(_session(sid, idle_s=3600.0, closed=closed))
    store.add(_session("fresh", closed=closed))
    assert store.sweep() == 2
    assert reasons == ["ttl", "ttl"]
    assert sorted(closed) == ["a", "b"]  # swept sessions are handed to the prefix cache (close)
    assert len(store) == 1


def test_the_sweep_keeps_a_session_idle_for_less_than_the_ttl():
    """Idle for 1.5 TTL is past the TTL: swept (not only after some multiple of it); idle for half of it is kept."""
    store = _store(session_ttl_s=100.0)
    store.add(_session("old", idle_s=150.0))
    store.add(_session("young", idle_s=50.0))
    assert store.sweep() == 1
    store.get("young")  # still there


def test_reserve_sweeps_idle_sessions_first_so_none_is_evicted_for_room():
    """reserve() drops expired sessions before it counts: a full store of expired sessions makes room
    without an LRU eviction of a live one (and says "ttl", not "lru")."""
    reasons: list[str] = []
    store = _store(reasons, max_sessions=2, session_ttl_s=60.0)
    store.add(_session("live", owner="k"))
    store.add(_session("stale", owner="other", idle_s=3600.0))
    store.reserve("k")
    assert reasons == ["ttl"]
    store.get("live")


def test_a_released_negative_amount_changes_nothing():
    """release() of a negative amount (a request that claimed nothing) never adds to the held bytes."""
    store = _store(max_kv_bytes=1000)
    store.claim("", 100)
    store.release(-50)
    assert store.claimed_bytes == 100
    store.release(100)
    assert store.claimed_bytes == 0


def test_a_claim_is_held_until_released_and_counts_against_sessions():
    """claim() holds its bytes (claimed_bytes, and the cap other requests see) until release()."""
    store = _store(max_kv_bytes=1000)
    store.claim("", 600)
    assert store.claimed_bytes == 600
    assert not store.try_claim(401)
    with pytest.raises(ApiError) as err:
        store.ensure_kv("", 401)
    assert err.value.status == 503
    store.release(600)
    assert store.try_claim(1000)


def test_the_count_bound_is_exact_and_evicts_the_least_recently_used_of_the_owner():
    """max_sessions sessions fit; the next one evicts the owner's least recently used idle session
    (reason "lru"), not the most recent, and a session read with get() becomes the most recent."""
    reasons: list[str] = []
    store = _store(reasons, max_sessions=3)
    for sid in ("a", "b", "c"):
        store.add(_session(sid))
    assert len(store) == 3 and reasons == []
    store.get("a")  # a is now the most recent: b is the LRU
    store.add(_session("d"))
    assert reasons == ["lru"] and len(store) == 3
    with pytest.raises(ApiError):
        store.get("b")
    for sid in ("a", "c", "d"):
        store.get(sid)


def test_kv_eviction_says_kv_bytes_and_takes_only_what_is_needed():
    """Over the KV cap (but not the count), the owner's LRU idle sessions go one at a time with
    reason "kv_bytes", until the new bytes fit."""
    reasons: list[str] = []
    store = _store(reasons, max_kv_bytes=1000, max_sessions=10)
    for sid in ("a", "b", "c"):
        store.add(_session(sid, nbytes=300))
    store.reserve("", 200)  # 900 + 200 > 1000: one 300-byte session must go, only one
    assert reasons == ["kv_bytes"] and len(store) == 2
    with pytest.raises(ApiError):
        store.get("a")


def test_ensure_kv_never_evicts_the_session_it_grows_nor_a_busy_or_foreign_one():
    """ensure_kv(busy=id) may evict the owner's other idle sessions, never the one growing, a busy
    one, or another owner's: with none left it is a 503 naming the KV cache."""
    store = _store(max_kv_bytes=1000, max_sessions=10)
    store.add(_session("grow", owner="k", nbytes=400))
    store.add(_session("theirs", owner="other", nbytes=400))
    busy = _session("busy", owner="k", nbytes=100)
    store.add(busy)
    with busy.lock:
        with pytest.raises(ApiError) as err:
            store.ensure_kv("k", 200, busy="grow")
    assert err.value.status == 503 and "KV cache" in str(err.value)
    assert len(store) == 3
    store.ensure_kv("k", 200, busy="grow")  # now "busy" is idle: it goes
    assert len(store) == 2
    store.get("grow")
    store.get("theirs")


def test_ensure_kv_of_nothing_never_evicts_even_over_the_cap():
    """ensure_kv(0) (a round that needs no new rows) evicts nothing, even where the store is
    already over its cap (a claim took the room meanwhile)."""
    reasons: list[str] = []
    store = _store(reasons, max_kv_bytes=1000)
    store.add(_session("a", nbytes=600))
    store.add(_session("b", nbytes=300))
    store.claim("x", 0)
    store._claimed = 500  # a completion's hold: the store is over its cap now
    store.ensure_kv("", 0, busy="b")
    assert reasons == [] and len(store) == 2


def test_all_busy_is_a_429_and_kv_full_is_a_503():
    store = _store(max_sessions=1, max_kv_bytes=1000)
    held = _session("a", nbytes=900)
    store.add(held)
    with held.lock:
        with pytest.raises(ApiError) as full:
            store.reserve("")
        with pytest.raises(ApiError) as kv:
            store.ensure_kv("", 200)
    assert full.value.status == 429 and "busy" in str(full.value)
    assert kv.value.status == 503


def test_another_owner_can_neither_get_nor_remove_a_session():
    store = _store()
    closed: list[str] = []
    store.add(_session("a", owner="k", closed=closed))
    with pytest.raises(ApiError) as err:
        store.get("a", "other")
    assert err.value.status == 404
    assert store.remove("a", "other") is False and len(store) == 1 and closed == []
    assert store.remove("a", "k") is True and len(store) == 0 and closed == ["a"]
    assert store.remove("a", "k") is False


def test_get_marks_the_session_used_now():
    """get() refreshes last_used: a session in use is never swept as idle."""
    store = _store(session_ttl_s=60.0)
    store.add(_session("a", idle_s=3600.0))
    store.get("a")
    assert store.sweep() == 0 and len(store) == 1


# ----------------------------------------------------------------------------- one edge session, in process


VOCAB = 6
SETTINGS = ServerSettings(max_gamma=8)


def _model(max_length: int | None = None) -> ToyLM:
    model = ToyLM(VOCAB, order=2, seed=3)
    if max_length is not None:
        model.max_length = max_length
    return model


def _edge(model: ToyLM | None = None, **fields):
    body = {"prompt_ids": [1, 2, 3], "temperature": 0.0, **fields}
    return create_session(CreateSessionRequest(**body), model or _model(), None, SETTINGS, "sid")


def _verify(session, **body):
    with session.lock:
        return session.verify(VerifyRequest(**body), SETTINGS)


def test_a_retried_seq_is_marked_replayed_and_a_changed_retry_is_a_409():
    """The first answer of a round says replayed=False; a retry of the same seq with the same body
    returns the stored verdict with replayed=True; a retry with another draft is a 409."""
    session, _ = _edge()
    first = _verify(session, seq=0, draft_tokens=[1, 2])
    assert first.metrics.replayed is False
    again = _verify(session, seq=0, draft_tokens=[1, 2])
    assert again.metrics.replayed is True and again.tokens == first.tokens
    with pytest.raises(ApiError) as err:
        _verify(session, seq=0, draft_tokens=[2, 1])
    assert err.value.status == 409 and "different draft" in str(err.value)
    assert session.next_seq == 1


def test_a_replayed_round_names_the_last_token_and_unverified_tokens_are_counted():
    """next_token is the round's last token; each unverified token is counted, and a session that
    took any is no longer lossless (in info() and in the round's metrics)."""
    session, _ = _edge()
    assert session.lossless
    reply = _verify(session, seq=0, unverified_tokens=[1, 2, 3], draft_tokens=[])
    assert session.unverified == 3 and session.info().unverified == 3
    assert not session.lossless and reply.metrics.lossless is False
    # greedy on the toy: draft the target's own continuation so the round emits several tokens
    twin, _ = _edge()
    probe = _verify(twin, seq=0, draft_tokens=[])
    follow = [probe.next_token]
    for seq in range(1, 4):
        follow.append(_verify(twin, seq=seq, draft_tokens=[]).next_token)
    fresh, _ = _edge()
    r = _verify(fresh, seq=0, draft_tokens=follow[:3])
    assert len(r.tokens) >= 2 and r.next_token == r.tokens[-1]


def test_a_resumed_sessions_committed_count_includes_its_generated_ids():
    """committed counts tokens after the prompt, a resumed sequence's generated_ids included."""
    session, _ = _edge(generated_ids=[4, 5])
    assert session.committed == 2 and session.info().committed == 2
    r = _verify(session, seq=0)
    assert r.metrics.committed == 2 + len(r.tokens)


def test_a_draft_of_exactly_max_gamma_is_verified_and_one_more_is_refused():
    session, _ = _edge()
    _verify(session, seq=0, draft_tokens=[1] * SETTINGS.max_gamma)
    with pytest.raises(ApiError) as err:
        _verify(session, seq=1, draft_tokens=[1] * (SETTINGS.max_gamma + 1))
    assert err.value.status == 400 and "at most 8" in str(err.value)


def test_a_model_error_in_a_round_is_a_400_and_rolls_the_cache_and_generator_back():
    """A SpecdecError raised mid-round (after the cache grew, after the generator drew) is a 400,
    and the session's cache length and generator are exactly as before the round."""
    session, _ = _edge(temperature=1.0, seed=5, wire="coupled")
    target = session.target
    length = target.cache.length
    state = target.generator.get_state().clone()
    real = target.verify

    def failing(draft, **kw):
        real(draft, **kw)  # the round ran: cache grown, generator advanced
        torch.rand(4, generator=target.generator)
        raise ModelError("the target's logits are not finite")

    target.verify = failing
    with pytest.raises(ApiError) as err:
        _verify(session, seq=0, draft_tokens=[1, 2])
    assert err.value.status == 400 and "not finite" in str(err.value)
    assert target.cache.length == length
    assert torch.equal(target.generator.get_state(), state)


def test_a_stale_seq_older_than_the_last_round_is_a_409_and_changes_nothing():
    """Only the last round may be repeated: a seq two or more rounds old is out of order (409),
    not a new round."""
    session, _ = _edge()
    for seq in range(3):
        _verify(session, seq=seq)
    context = session.target.context.tolist()
    for stale in (0, 1):
        with pytest.raises(ApiError) as err:
            _verify(session, seq=stale)
        assert err.value.status == 409 and "expects seq 3 (or 2 to repeat the last round)" in str(err.value)
    assert session.next_seq == 3 and session.target.context.tolist() == context


def test_a_tree_draft_is_never_capped():
    """draft_cap cuts only chains: a tree round under a cap answers exactly as without one."""
    capped, _ = _edge()
    plain, _ = _edge()
    body = dict(seq=0, draft_tokens=[1, 2, 3, 4], parents=[-1, -1, 0, 1])
    with capped.lock:
        a = capped.verify(VerifyRequest(**body), SETTINGS, draft_cap=1)
    b = _verify(plain, **body)
    assert a.metrics.capped_from is None and a.metrics.gamma == 4
    assert (a.tokens, a.num_accepted, a.path) == (b.tokens, b.num_accepted, b.path)


def test_each_rounds_logprobs_are_its_own_tokens_and_finite():
    """A logprobs session's reply scores exactly the tokens that round emitted (not earlier rounds'
    again), and a token the sampling removed (top_k) is written as -9999, never -inf (JSON has no
    infinity)."""
    session, _ = _edge(temperature=1.0, seed=3, wire="coupled", top_k=1, logprobs=3)
    for seq in range(3):
        r = _verify(session, seq=seq, draft_tokens=[1, 2])
        assert len(r.logprobs) == len(r.tokens)
        values = [lp.logprob for lp in r.logprobs] + [v for lp in r.logprobs for _, v in lp.top]
        assert all(v >= -9999.0 for v in values), values
        assert any(v == -9999.0 for v in values)  # top_k=1 removed the others: they are there, at -9999
        r.model_dump_json()  # serialisable as it stands


class _VocabTokenizer:
    """A tokenizer with a vocabulary to read (its digest is what an edge compares)."""

    def get_vocab(self) -> dict[str, int]:
        return {c: i for i, c in enumerate("abcdef")}


def test_an_edge_with_another_tokenizer_is_refused_and_the_same_one_is_accepted():
    from specdec.tokenizer import vocab_digest

    tok = _VocabTokenizer()
    model = ToyLM(VOCAB, order=2, seed=3)
    ours = vocab_digest(tok)
    create_session(CreateSessionRequest(prompt_ids=[1], temperature=0.0, vocab_digest=ours), model, tok, SETTINGS, "a")
    theirs = "0" * 64
    with pytest.raises(ApiError) as err:
        create_session(CreateSessionRequest(prompt_ids=[1], temperature=0.0, vocab_digest=theirs), model, tok, SETTINGS, "b")
    assert err.value.status == 400 and "tokenizer" in str(err.value)


def test_unverified_tokens_past_a_spent_budget_say_max_new_tokens_was_reached():
    """With nothing left to commit, a round carrying unverified tokens is told the budget is spent
    (and how much was committed), not that it carries too many."""
    session, _ = _edge(max_new_tokens=1)
    _verify(session, seq=0)
    with pytest.raises(ApiError) as err:
        _verify(session, seq=1, unverified_tokens=[1, 2])
    assert err.value.status == 400 and "max_new_tokens reached: 1 committed" in str(err.value)


def test_a_max_new_tokens_past_the_context_is_cut_to_the_room_left():
    """max_new_tokens larger than the context's room is the room: the session commits up to the
    context's last position, exactly as without max_new_tokens, and then says its budget is spent."""
    model = ToyLM(VOCAB, order=2, seed=3)
    model.max_length = 24
    runs = []
    for extra in ({}, {"max_new_tokens": 100}):
        req = CreateSessionRequest(prompt_ids=[1, 2, 3, 4, 5] * 4, temperature=0.0, **extra)
        session, reply = create_session(req, model, None, SETTINGS, "s")
        tokens, seq = [], 0
        while len(tokens) < 4:
            tokens += _verify(session, seq=seq, draft_tokens=[1, 2]).tokens
            seq += 1
        with pytest.raises(ApiError) as err:
            _verify(session, seq=seq)
        assert err.value.status == 400 and "max_new_tokens reached" in str(err.value)
        runs.append((tokens, reply.max_length, session.limit))
    assert runs[0] == runs[1] and len(runs[0][0]) == 4 and runs[0][2] == 24


def test_a_generated_id_outside_the_vocabulary_is_a_400_that_names_it():
    """generated_ids are checked against the vocabulary like the prompt: id == vocab is a 400 naming
    generated_ids[i], before any pass."""
    with pytest.raises(ApiError) as err:
        _edge(generated_ids=[1, VOCAB], repetition_penalty=1.2)
    assert err.value.status == 400 and f"generated_ids[1] = {VOCAB} is outside the vocabulary" in str(err.value)
    with pytest.raises(ApiError) as err:
        _edge(generated_ids=[VOCAB])
    assert err.value.status == 400 and "generated_ids[0]" in str(err.value)


def test_every_sampling_field_reaches_the_targets_config():
    """The session samples under the edge's whole config: each penalty, top_k/p and min_p arrive."""
    fields = dict(temperature=0.8, top_k=3, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                  frequency_penalty=0.3, presence_penalty=0.7)
    session, _ = _edge(seed=1, wire="coupled", **fields)
    assert {k: getattr(session.target.cfg, k) for k in fields} == fields


def test_the_reply_names_the_sessions_own_max_length_under_a_budget():
    """max_length in the reply is the session's bound (prompt + max_new_tokens + a round's rows), as
    info() says; max_context is the model's context."""
    session, reply = _edge(max_new_tokens=5)
    assert reply.max_length == session.target.max_length == session.info().max_length
    assert reply.max_length < reply.max_context == ToyLM(VOCAB, order=2, seed=3).max_length


class _EmptyTokenizer:
    def encode(self, text):  # a tokenizer that gives no ids for this text
        return []


def test_a_text_prompt_that_encodes_to_nothing_says_so():
    with pytest.raises(ApiError) as err:
        create_session(CreateSessionRequest(prompt="  x", temperature=0.0), ToyLM(VOCAB, order=2, seed=3),
                       _EmptyTokenizer(), SETTINGS, "s")
    assert err.value.status == 400 and "encodes to no tokens" in str(err.value)


def test_a_method_of_another_wire_mode_and_a_grammar_without_a_tokenizer_are_400s():
    """Errors the config raises as ValueError (a method the default wire mode does not allow, a
    grammar on a server without a tokenizer) are 400s with their message, not 500s."""
    with pytest.raises(ApiError) as err:
        _edge(method="block")  # temperature 0: the default wire is greedy
    assert err.value.status == 400 and "not available in wire mode 'greedy'" in str(err.value)
    with pytest.raises(ApiError) as err:
        _edge(grammar="start: 'a'")
    assert err.value.status == 400 and "needs the server's tokenizer" in str(err.value)


def test_growth_and_cache_bytes_read_the_cache_as_it_says():
    """growth_bytes(cache, n) asks the cache for exactly n positions (0 where it never grows);
    cache_bytes reads nbytes (0 where the cache does not say)."""
    from specdec.server.sessions import cache_bytes, growth_bytes

    asked = []
    cache = SimpleNamespace(growth_bytes=lambda n: asked.append(n) or 10 * n, nbytes=77)
    assert growth_bytes(cache, 3) == 30 and asked == [3]
    assert growth_bytes(SimpleNamespace(), 3) == 0
    assert cache_bytes(cache) == 77 and cache_bytes(SimpleNamespace()) == 0 and cache_bytes(SimpleNamespace(nbytes=None)) == 0


def test_a_round_that_fails_after_committing_unverified_tokens_ends_the_session():
    """Unverified tokens are committed before the draft is verified; if the verification then fails,
    they stay committed, so a retry of the round would commit them twice. Every later round (a retry
    included) is a 409 that says how to go on, and the context holds each unverified token once."""
    session, _ = _edge()
    target = session.target
    real, calls = target.verify, []

    def fails_second(draft, **kw):  # the first call is the append of the unverified tokens
        calls.append(draft)
        if len(calls) == 2:
            raise ModelError("the target's logits are not finite")
        return real(draft, **kw)

    target.verify = fails_second
    with pytest.raises(ApiError) as err:
        _verify(session, seq=0, unverified_tokens=[4, 5], draft_tokens=[1])
    assert err.value.status == 400
    target.verify = real
    context = target.context.tolist()
    assert context == [1, 2, 3, 4, 5]
    for body in ({"seq": 0, "unverified_tokens": [4, 5], "draft_tokens": [1]}, {"seq": 1}):
        with pytest.raises(ApiError) as err:
            _verify(session, **body)
        assert err.value.status == 409 and "generated_ids" in str(err.value)
    assert target.context.tolist() == context and session.next_seq == 0


def test_a_failed_round_without_unverified_tokens_can_be_repeated():
    """A round that commits nothing before it fails leaves the session as it was: its retry runs."""
    session, _ = _edge()
    target = session.target
    real = target.verify

    def fails(draft, **kw):
        raise ModelError("the target's logits are not finite")

    target.verify = fails
    with pytest.raises(ApiError):
        _verify(session, seq=0, draft_tokens=[1])
    target.verify = real
    assert _verify(session, seq=0, draft_tokens=[1]).seq == 0


def test_two_sessions_created_at_once_never_hold_more_than_the_kv_cap():
    """Two creations interleaved as two request threads run them (both reserve, both prefill, both
    add): reserve() holds nothing, so add() checks the bytes again and the store ends within its KV
    cap (evicting the owner's idle sessions, or refusing the second with a 503)."""
    store = _store(max_kv_bytes=1000, max_sessions=10)
    store.reserve("a", 600)  # request 1: room for 600 bytes
    store.reserve("b", 600)  # request 2, before request 1's session is added: the same room again
    store.add(_session("one", owner="a", nbytes=600))  # request 1's prefill is done
    with pytest.raises(ApiError) as err:
        store.add(_session("two", owner="b", nbytes=600))
    assert err.value.status == 503 and "KV cache memory is full" in str(err.value)
    assert store.kv_bytes() == 600
    store.add(_session("three", owner="a", nbytes=600))  # the owner's own idle session makes room
    assert store.kv_bytes() == 600 and len(store) == 1


def _greedy_continuation(prompt: list[int], n: int) -> list[int]:
    """The toy target's greedy continuation of ``prompt`` (n tokens), one empty round at a time."""
    twin, _ = _edge(prompt_ids=prompt)
    return [_verify(twin, seq=seq).next_token for seq in range(n)]


# ----------------------------------------------------------------------------- a round's limits


def test_unverified_tokens_count_against_max_new_tokens_in_the_same_round():
    """A round's length limit is what is left after its unverified tokens were appended: with
    max_new_tokens=3 and 2 unverified tokens, a draft the target accepts in full still commits only
    1 token, and the session never holds more than prompt + 3."""
    follow = _greedy_continuation([1, 2, 3, 4, 5], 3)  # what the target would accept after the forced tokens
    session, _ = _edge(max_new_tokens=3)
    reply = _verify(session, seq=0, unverified_tokens=[4, 5], draft_tokens=follow)
    assert len(reply.tokens) == 1 and reply.tokens == follow[:1]
    assert session.committed == 3 and session.target.context.numel() == session.limit


def test_unverified_tokens_and_a_draft_past_the_context_are_refused_before_anything_is_committed():
    """The room check counts the unverified tokens too: when they and the draft do not fit the
    context, the round is a 400 "context full" and the session is untouched (not broken: the same
    seq then runs with a draft that fits)."""
    session, _ = _edge(_model(24), prompt_ids=[1, 2, 3, 4, 5] * 4)  # 20 of 24: 4 positions left
    with pytest.raises(ApiError) as err:
        _verify(session, seq=0, unverified_tokens=[1, 2], draft_tokens=[1, 2])  # 2 + 2 + 1 > 4
    assert err.value.status == 400 and "context full" in str(err.value)
    assert session.target.context.numel() == 20 and session.unverified == 0 and session.broken is None
    assert _verify(session, seq=0, unverified_tokens=[1, 2], draft_tokens=[1]).seq == 0


def test_a_chain_shaped_tree_counts_its_depth_plus_the_bonus_token_for_room():
    """A tree's room is its deepest path plus the bonus token: a tree of depth 2 after one unverified
    token needs 1 + 3 positions; with 3 left it is a clean 400 "context full" and nothing is
    committed (the unverified token is not appended, the session stays usable)."""
    session, _ = _edge(_model(24), prompt_ids=[1, 2, 3, 4, 5] * 4 + [1])  # 21 of 24: 3 positions left
    with pytest.raises(ApiError) as err:
        _verify(session, seq=0, unverified_tokens=[4], draft_tokens=[1, 2], parents=[-1, 0])
    assert err.value.status == 400 and "context full" in str(err.value)
    assert session.target.context.numel() == 21 and session.broken is None
    assert _verify(session, seq=0, unverified_tokens=[4], draft_tokens=[1]).seq == 0


def test_a_failure_that_is_not_a_specdec_error_still_rolls_the_cache_and_generator_back():
    """Any exception mid-round (here a RuntimeError, which stays a 500) puts the cache length and
    the generator back, so a retry of the round scores from the same state."""
    session, _ = _edge(temperature=1.0, seed=5, wire="coupled")
    target = session.target
    length, state = target.cache.length, target.generator.get_state().clone()
    real = target.verify

    def failing(draft, **kw):
        real(draft, **kw)
        torch.rand(4, generator=target.generator)
        raise RuntimeError("out of memory")

    target.verify = failing
    with pytest.raises(RuntimeError):
        _verify(session, seq=0, draft_tokens=[1, 2])
    assert target.cache.length == length
    assert torch.equal(target.generator.get_state(), state)


def test_a_resumed_sessions_spent_budget_counts_only_this_sessions_tokens():
    """"max_new_tokens reached: N committed" counts what this session committed, not the resumed
    sequence's generated_ids (those were the earlier session's)."""
    session, _ = _edge(generated_ids=[4, 5], max_new_tokens=1)
    _verify(session, seq=0)
    with pytest.raises(ApiError) as err:
        _verify(session, seq=1)
    assert err.value.status == 400 and "max_new_tokens reached: 1 committed" in str(err.value)


# ----------------------------------------------------------------------------- creation


def test_a_prompt_exactly_as_long_as_the_context_says_there_is_no_room_to_generate():
    """A prompt of max_length tokens is refused by the session layer's own message (no room to
    generate), the boundary included."""
    with pytest.raises(ApiError) as err:
        _edge(_model(12), prompt_ids=[1, 2, 3] * 4)
    assert err.value.status == 400 and "no room to generate" in str(err.value)
    _edge(_model(12), prompt_ids=[1, 2, 3] * 3 + [1, 2])  # 11 of 12: one position to generate


# ----------------------------------------------------------------------------- the store


class _HeldLock:
    """A lock that says it is held (a round running), without blocking the test's own thread."""

    def __init__(self) -> None:
        self.held = True

    def locked(self) -> bool:
        return self.held

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def test_the_sweep_never_drops_a_busy_session_however_long_idle():
    """A session whose lock is held (a round running) is not swept, even idle past the TTL."""
    store = _store(session_ttl_s=60.0)
    busy = _session("busy", idle_s=3600.0)
    busy.lock = _HeldLock()
    store.add(busy)
    assert store.sweep() == 0 and len(store) == 1
    busy.lock.held = False
    assert store.sweep() == 1  # idle and no longer busy: now it goes


def test_a_session_idle_exactly_the_ttl_is_kept(monkeypatch):
    """Swept only when idle *longer* than the TTL (a fake clock: idle exactly 60 s of a 60 s TTL stays)."""
    now = [1000.0]
    monkeypatch.setattr(sessions_mod.time, "monotonic", lambda: now[0])
    store = _store(session_ttl_s=60.0)
    s = _session("a")
    s.last_used = 940.0
    store.add(s)
    assert store.sweep() == 0
    now[0] = 1000.5
    assert store.sweep() == 1


def test_a_claim_sweeps_expired_sessions_before_it_counts_the_bytes():
    """claim() drops sessions idle past the TTL first: another key's expired session holding the
    bytes makes room, rather than the claim being refused with a 503."""
    reasons: list[str] = []
    store = _store(reasons, max_kv_bytes=1000, session_ttl_s=60.0)
    store.add(_session("stale", owner="other", nbytes=800, idle_s=3600.0))
    store.claim("k", 500)
    assert reasons == ["ttl"] and store.claimed_bytes == 500 and len(store) == 0


def test_a_claim_is_not_bound_by_the_session_count():
    """A completion's claim holds bytes, not a session: with max_sessions sessions stored and room
    for the bytes, nothing is evicted."""
    reasons: list[str] = []
    store = _store(reasons, max_sessions=1, max_kv_bytes=1000)
    store.add(_session("a", nbytes=100))
    store.claim("", 100)
    assert reasons == [] and len(store) == 1 and store.claimed_bytes == 100


def test_removing_a_session_waits_for_its_running_round_before_closing_it():
    """keep_ended() closes a session only once the round running on it ends (its lock is free):
    the prefix cache never reads rows a round is still writing."""
    closed: list[str] = []
    store = _store()
    s = _session("a", closed=closed)
    store.add(s)
    s.lock.acquire()  # a round is running
    remover = threading.Thread(target=lambda: store.remove("a"))
    remover.start()
    remover.join(0.3)
    assert closed == [] and remover.is_alive()
    s.lock.release()
    remover.join(10)
    assert closed == ["a"]


def test_unverified_tokens_accumulate_over_rounds():
    """Each round's unverified tokens add to the session's count; a later round does not reset it."""
    session, _ = _edge()
    _verify(session, seq=0, unverified_tokens=[1], draft_tokens=[])
    _verify(session, seq=1, unverified_tokens=[2, 3], draft_tokens=[])
    assert session.unverified == 3 and session.info().unverified == 3


def test_an_out_of_order_seq_after_the_first_round_names_the_retry_seq():
    """After round 0 the 409 says seq 1 is expected, or 0 to repeat the last round; before any round
    it names seq 0 alone."""
    session, _ = _edge()
    with pytest.raises(ApiError) as err:
        _verify(session, seq=3)
    assert err.value.status == 409 and "expects seq 0" in str(err.value) and "repeat" not in str(err.value)
    _verify(session, seq=0)
    with pytest.raises(ApiError) as err:
        _verify(session, seq=3)
    assert err.value.status == 409 and "expects seq 1 (or 0 to repeat the last round)" in str(err.value)


@pytest.mark.parametrize("field", ["draft_tokens", "unverified_tokens"])
def test_a_round_token_equal_to_the_vocabulary_size_is_a_400_that_names_it(field):
    """Ids run 0..vocab-1: an id of exactly vocab is refused with a 400 naming it, before anything changes."""
    session, _ = _edge()
    with pytest.raises(ApiError) as err:
        _verify(session, seq=0, **{field: [1, VOCAB]})
    assert err.value.status == 400 and f"{field}[1] = {VOCAB} is outside the vocabulary" in str(err.value)
    assert session.next_seq == 0 and session.committed == 0


def test_a_logprobs_session_refuses_unverified_tokens():
    session, _ = _edge(logprobs=2)
    with pytest.raises(ApiError) as err:
        _verify(session, seq=0, unverified_tokens=[1], draft_tokens=[])
    assert err.value.status == 400 and "logprobs" in str(err.value)
    assert session.committed == 0 and session.unverified == 0


def test_a_sparse_q_row_id_equal_to_the_vocabulary_size_is_a_400():
    session, _ = _edge(temperature=1.0, wire="sparse-q", seed=1)
    with pytest.raises(ApiError) as err:
        _verify(session, seq=0, draft_tokens=[1], q=[{"ids": [1, VOCAB], "probs": [0.5, 0.5]}])
    assert err.value.status == 400 and f"q row id {VOCAB}" in str(err.value)


def test_lossy_scalar_q_given_as_sparse_rows_is_a_400():
    session, _ = _edge(temperature=1.0, wire="lossy-scalar", seed=1)
    with pytest.raises(ApiError) as err:
        _verify(session, seq=0, draft_tokens=[1], q=[{"ids": [1], "probs": [1.0]}])
    assert err.value.status == 400 and "lossy-scalar" in str(err.value)


def test_a_vocab_digest_is_not_checked_on_a_server_without_a_tokenizer():
    """A server with no tokenizer has nothing to compare an edge's digest with: the session is made."""
    session, reply = _edge(vocab_digest="0" * 64)
    assert reply.session_id == "sid"


def test_a_resumed_sessions_generated_ids_count_toward_min_tokens():
    """min_tokens' floor over the stop ids sees generated_ids as generated: resumed past the floor,
    the stop id the target prefers is emitted at once."""
    ref, _ = _edge(prompt_ids=[1, 2, 3, 4, 5, 1])
    stop = _verify(ref, seq=0).next_token
    resumed, _ = _edge(prompt_ids=[1, 2, 3], generated_ids=[4, 5, 1], min_tokens=3, floor_ids=[stop])
    assert _verify(resumed, seq=0).next_token == stop
    # the same context with one generated token short of the floor: the stop id is masked
    floored, _ = _edge(prompt_ids=[1, 2, 3, 4], generated_ids=[5, 1], min_tokens=3, floor_ids=[stop])
    assert _verify(floored, seq=0).next_token != stop


def test_try_claim_of_nothing_is_granted_even_over_the_cap():
    store = _store(max_kv_bytes=1000)
    a = _session("a", nbytes=900)
    store.add(a)
    a.target.cache.nbytes = 1500  # the session's cache grew past the cap
    assert store.try_claim(0) is True and store.claimed_bytes == 0


def test_try_claim_may_fill_the_cap_exactly():
    store = _store(max_kv_bytes=1000)
    store.add(_session("a", nbytes=600))
    assert store.try_claim(400) is True and store.claimed_bytes == 400
    assert store.try_claim(1) is False and store.claimed_bytes == 400


def test_a_claim_of_nothing_evicts_nothing_even_over_the_cap():
    reasons: list[str] = []
    store = _store(reasons, max_kv_bytes=1000)
    a = _session("a", nbytes=900)
    store.add(a)
    a.target.cache.nbytes = 1500  # the session's cache grew past the cap
    store.claim("", 0)
    assert reasons == [] and len(store) == 1 and store.claimed_bytes == 0


def test_an_eviction_for_a_full_count_says_lru_even_when_bytes_are_short_too():
    reasons: list[str] = []
    store = _store(reasons, max_sessions=1, max_kv_bytes=1000)
    store.add(_session("a", nbytes=900))
    store.reserve("", 200)
    assert reasons == ["lru"] and len(store) == 0


def test_add_keeps_the_session_count_bound_without_a_reserve():
    """add() itself holds max_sessions: a session stored past a reserve that another took evicts the
    owner's least recently used one."""
    reasons: list[str] = []
    store = _store(reasons, max_sessions=1)
    store.add(_session("a"))
    store.add(_session("b"))
    assert reasons == ["lru"] and len(store) == 1
    store.get("b")
    with pytest.raises(ApiError):
        store.get("a")


def test_serialized_does_not_wrap_a_serialized_model_twice():
    once = sessions_mod.serialized(_model())
    assert sessions_mod.serialized(once) is once


def test_an_empty_q_on_a_greedy_session_counts_as_none():
    """A greedy session refuses q rows, but an empty q list (an empty draft's) is no q at all."""
    session, _ = _edge()
    r = _verify(session, seq=0, draft_tokens=[], q=[])
    assert len(r.tokens) == 1 and session.next_seq == 1


def test_a_reserve_that_cannot_fit_evicts_none_of_the_owners_sessions():
    """Another key's session holds bytes the owner cannot evict: a reservation that would not fit
    even after every idle session of the owner is gone is a 503 that evicts nothing (evicting them
    would lose the owner's sessions for no room)."""
    reasons: list[str] = []
    store = _store(reasons, max_kv_bytes=1000)
    store.add(_session("mine", owner="k", nbytes=300))
    store.add(_session("theirs", owner="other", nbytes=600))
    with pytest.raises(ApiError) as err:
        store.reserve("k", 500)  # 600 (not evictable) + 500 > 1000
    assert err.value.status == 503
    assert reasons == [] and len(store) == 2 and store.get("mine", "k").id == "mine"


def test_a_claim_larger_than_the_whole_cap_evicts_nothing():
    reasons: list[str] = []
    store = _store(reasons, max_kv_bytes=1000)
    store.add(_session("mine", owner="k", nbytes=300))
    with pytest.raises(ApiError) as err:
        store.claim("k", 1500)
    assert err.value.status == 503 and reasons == [] and len(store) == 1 and store.claimed_bytes == 0


def test_a_reserve_that_evicting_can_satisfy_still_evicts_only_what_it_needs():
    reasons: list[str] = []
    store = _store(reasons, max_kv_bytes=1000)
    store.add(_session("old", owner="k", nbytes=300))
    store.add(_session("new", owner="k", nbytes=300))
    store.add(_session("theirs", owner="other", nbytes=300))
    store.reserve("k", 300)  # 900 + 300 > 1000: evicting "old" (the LRU) is enough
    assert reasons == ["kv_bytes"] and len(store) == 2 and store.get("new", "k").id == "new"
