"""The OpenAI endpoints' request validation, usage / finish_reason bookkeeping and
stream assembly, run in-process on a tiny native model with the letter tokenizer (token i <-> the
letter 'a' + i), so each test takes well under a second."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from specdec.drafters import ModelDrafter
from specdec.engine import Engine
from specdec.models.registry import LoadedModel
from specdec.sampling import SamplingConfig
from specdec.server import ServerSettings, create_app
from specdec.server.openai_api import _best, _spare_slot, _stats, _usage
from tiny import tiny_native
from toy_server import ChatLetters

VOCAB = 26
CONTEXT = 64


@pytest.fixture(scope="module")
def api():
    model, draft = tiny_native(vocab=VOCAB, max_length=CONTEXT), tiny_native(vocab=VOCAB, max_length=CONTEXT, seed=1)
    app = create_app(model, tokenizer=ChatLetters(), settings=ServerSettings(model_name="tiny"),
                     drafter_factory=lambda: ModelDrafter(draft), drafter_name="tiny")
    with TestClient(app, base_url="http://localhost") as c:
        yield c


def _ok(r):
    assert r.status_code == 200, r.text
    return r.json()


def _bad(r, status=400):
    assert r.status_code == status, r.text
    return r.json()["error"]


def _events(r):
    """The data payloads of a server-sent event stream, [DONE] as the string."""
    assert r.status_code == 200, r.text
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


CHAT = [{"role": "user", "content": "abc"}]


@pytest.fixture(scope="module")
def same():
    """The tiny model drafting for itself: every draft accepted, so streamed pieces bring several tokens
    (no batching: no load-dependent draft cap, so γ is the request's)."""
    model = tiny_native(vocab=VOCAB, max_length=CONTEXT)
    app = create_app(model, tokenizer=ChatLetters(), settings=ServerSettings(model_name="tiny", batching=False),
                     drafter_factory=lambda: ModelDrafter(model), drafter_name="self")
    with TestClient(app, base_url="http://localhost") as c:
        yield c


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", [
    {"top_p": 0.0},  # OpenAI's top_p is in (0, 1]
    {"seed": -1},
    {"repetition_penalty": 0.0},  # a divisor: strictly positive
    {"min_p": 1.01},
    {"stop": [f"s{i}" for i in range(17)]},  # at most 16 stop strings
    {"prompt": [VOCAB]},  # a prompt token one past the vocabulary
    {"stop_token_ids": [VOCAB]},
    {"truncate_prompt_tokens": 0},
    {"truncate_prompt_tokens": CONTEXT + 1},
    {"max_tokens": 0},  # nothing to generate needs echo
    {"stream_options": {"include_usage": True}},  # without stream
    {"prompt_logprobs": 1, "stream": True},
    {"use_beam_search": True},  # a vLLM option that would change the output: refused, not ignored
    {"method": "greedy", "temperature": 1.0},  # greedy verification needs temperature 0
    {"min_tokens": 5, "max_tokens": 4},
])
def test_one_past_each_bound_or_a_forbidden_combination_is_a_400(api, bad):
    """Each request is refused with a 400 that carries a message, never answered."""
    body = {"prompt": "abc", "max_tokens": 2, "temperature": 0, **bad}
    assert _bad(api.post("/v1/completions", json=body))["message"]


@pytest.mark.parametrize("edge", [
    {"top_p": 1.0, "temperature": 2.0, "seed": 0},
    {"stop": [f"s{i}" for i in range(16)]},
    {"prompt": [VOCAB - 1]},
    {"stop_token_ids": [VOCAB - 1]},
    {"truncate_prompt_tokens": CONTEXT, "max_tokens": 1},
    {"min_tokens": 4, "max_tokens": 4},  # min_tokens may equal max_tokens
    {"n": 2, "best_of": 2},  # best_of may equal n
    {"stop": [""]},  # an empty stop string stops nothing
    {"repetition_penalty": 100.0, "min_p": 1.0},
])
def test_each_bound_itself_is_accepted(api, edge):
    body = {"prompt": "abc", "max_tokens": 4, "temperature": 0, **edge}
    out = _ok(api.post("/v1/completions", json=body))
    assert out["choices"]


def test_stop_list_with_an_empty_string_changes_nothing(api):
    """An empty stop string is dropped, not a stop at the answer's first character."""
    plain = _ok(api.post("/v1/completions", json={"prompt": "abc", "max_tokens": 6, "temperature": 0}))
    empty = _ok(api.post("/v1/completions", json={"prompt": "abc", "max_tokens": 6, "temperature": 0, "stop": [""]}))
    assert empty["choices"][0]["text"] == plain["choices"][0]["text"] and len(plain["choices"][0]["text"]) == 6


def test_chat_refuses_echo_and_a_tokenize_call_with_both_prompt_and_messages(api):
    assert "echo" in _bad(api.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "echo": True}))["message"]
    assert _bad(api.post("/tokenize", json={"prompt": "abc", "messages": CHAT}))["message"]
    assert _bad(api.post("/tokenize", json={}))["message"]


def test_the_context_bounds_prompt_plus_max_tokens_to_its_last_position(api):
    """prompt + max_tokens may fill the context exactly; one more is a 400; a prompt filling it alone is one too."""
    full = [0] * (CONTEXT - 2)
    assert _ok(api.post("/v1/completions", json={"prompt": full, "max_tokens": 2, "temperature": 0, "ignore_eos": True}))
    assert "context" in _bad(api.post("/v1/completions", json={"prompt": full, "max_tokens": 3}))["message"]
    assert _ok(api.post("/v1/completions", json={"prompt": [0] * (CONTEXT - 1), "max_tokens": 1, "temperature": 0}))
    assert "context" in _bad(api.post("/v1/completions", json={"prompt": [0] * CONTEXT, "max_tokens": 1}))["message"]


def test_truncate_minus_one_with_echo_alone_keeps_all_but_one_position(api):
    """truncate_prompt_tokens -1 with max_tokens 0 (echo alone) keeps context - 1 tokens: the row
    scoring needs is left, as for an answer of one token."""
    out = _ok(api.post("/v1/completions", json={"prompt": "b" * (2 * CONTEXT), "max_tokens": 0, "echo": True,
                                                  "truncate_prompt_tokens": -1}))
    assert out["usage"]["prompt_tokens"] == CONTEXT - 1 and out["choices"][0]["text"] == "b" * (CONTEXT - 1)


def test_completions_default_to_sixteen_tokens(api):
    """/v1/completions without max_tokens generates 16 tokens (OpenAI's and vLLM's default)."""
    out = _ok(api.post("/v1/completions", json={"prompt": "abc", "temperature": 0, "ignore_eos": True}))
    assert out["usage"]["completion_tokens"] == 16 and out["choices"][0]["finish_reason"] == "length"


# ----------------------------------------------------------------------------- bookkeeping


def test_a_stop_token_ends_with_finish_reason_stop(api):
    """An answer ended by a stop token (the engine's "eos") reports OpenAI's "stop", never the engine's word."""
    plain = _ok(api.post("/v1/completions", json={"prompt": "abc", "max_tokens": 6, "temperature": 0}))
    first = ord(plain["choices"][0]["text"][0]) - ord("a")
    out = _ok(api.post("/v1/completions", json={"prompt": "abc", "max_tokens": 6, "temperature": 0,
                                                  "stop_token_ids": [first]}))
    assert out["choices"][0]["finish_reason"] == "stop" and out["usage"]["completion_tokens"] <= 1
    events = _events(api.post("/v1/completions", json={"prompt": "abc", "max_tokens": 6, "temperature": 0,
                                                         "stop_token_ids": [first], "stream": True}))
    assert [c["choices"][0]["finish_reason"] for c in events[:-1] if c["choices"]][-1] == "stop"


def test_acceptance_rate_is_accepted_over_proposed(same):
    st = _ok(same.post("/v1/completions", json={"prompt": "abc", "max_tokens": 12, "temperature": 0,
                                                   "gamma": 4}))["specdec"]
    assert st["draft_tokens_proposed"] > 0 and st["acceptance_rate"] == st["draft_tokens_accepted"] / st["draft_tokens_proposed"]
    assert st["tokens_per_target_call"] == 12 / st["target_calls"]


def test_usage_totals_add_up_for_several_prompts_and_choices(api):
    out = _ok(api.post("/v1/completions", json={"prompt": ["abc", "de"], "n": 2, "max_tokens": 3, "temperature": 0,
                                                  "ignore_eos": True}))
    u = out["usage"]
    assert (u["prompt_tokens"], u["completion_tokens"], u["total_tokens"]) == (5, 12, 17)


def test_best_of_candidates_all_count_in_usage(api):
    """best_of runs every candidate: usage counts all of them though n are returned."""
    out = _ok(api.post("/v1/completions", json={"prompt": "abc", "n": 1, "best_of": 3, "max_tokens": 4,
                                                  "temperature": 1.0, "seed": 3, "ignore_eos": True}))
    assert len(out["choices"]) == 1 and out["usage"]["completion_tokens"] == 12


def test_best_of_ranks_without_logprobs_as_with_them(api):
    """best_of ranks candidates by their mean log-probability whether or not the caller asked for
    logprobs: the same seed returns the same winner (searched over seeds 0..7 for one whose
    winner is not the first candidate)."""
    found = False
    for seed in range(8):
        kw = {"prompt": "abc", "n": 1, "best_of": 3, "max_tokens": 4, "temperature": 1.0, "seed": seed, "ignore_eos": True}
        ranked = _ok(api.post("/v1/completions", json={**kw, "logprobs": 0}))["choices"][0]
        plain = _ok(api.post("/v1/completions", json=kw))["choices"][0]
        first = _ok(api.post("/v1/completions", json={**kw, "best_of": 1}))["choices"][0]
        assert plain["text"] == ranked["text"] and plain["logprobs"] is None
        found |= plain["text"] != first["text"]
    assert found


@pytest.mark.parametrize("field, value", [("top_p", 0.0), ("seed", -1), ("repetition_penalty", 0.0), ("min_p", 1.01),
                                          ("temperature", 2.01), ("top_logprobs", 21),
                                          ("stop_token_ids", [VOCAB])])
def test_an_out_of_range_value_names_its_field_as_the_param(api, field, value):
    """OpenAI's error object names the field at fault in ``param`` (the openai client exposes it)."""
    r = api.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2, "logprobs": True, field: value})
    assert _bad(r)["param"] == field


def test_a_prompt_filling_the_context_is_refused_even_for_echo_alone(api):
    """Scoring the prompt alone (echo, max_tokens 0) needs a row past it: a prompt that fills the
    context is a 400, not an answer."""
    for scored in ({}, {"logprobs": 1}):
        r = api.post("/v1/completions", json={"prompt": [0] * CONTEXT, "max_tokens": 0, "echo": True, **scored})
        assert "fill the model's context" in _bad(r)["message"]


def test_two_kinds_of_structured_output_are_a_400(api):
    r = api.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "response_format": {"type": "json_object"},
                                          "guided_regex": "a+"})
    assert "one kind of structured output" in _bad(r)["message"]


def test_echo_of_a_truncated_prompt_is_the_part_read(api):
    """With truncate_prompt_tokens the echoed text is the prompt's kept tail, not the prompt as sent."""
    out = _ok(api.post("/v1/completions", json={"prompt": "abcdefgh", "max_tokens": 0, "echo": True,
                                                  "truncate_prompt_tokens": 3}))
    assert out["choices"][0]["text"] == "fgh" and out["usage"]["prompt_tokens"] == 3


def test_legacy_top_logprobs_always_hold_the_sampled_token(api):
    """logprobs 0: each position's top_logprobs is the sampled token alone (OpenAI's legacy shape)."""
    lp = _ok(api.post("/v1/completions", json={"prompt": "abc", "max_tokens": 5, "temperature": 1.0, "seed": 2,
                                                 "logprobs": 0}))["choices"][0]["logprobs"]
    assert [list(t) for t in lp["top_logprobs"]] == [[tok] for tok in lp["tokens"]]
    assert [t[tok] for t, tok in zip(lp["top_logprobs"], lp["tokens"])] == lp["token_logprobs"]


def test_each_of_n_seeded_choices_is_the_request_with_seed_plus_its_rank(api):
    kw = {"prompt": "abc", "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    many = [c["text"] for c in _ok(api.post("/v1/completions", json={**kw, "n": 3, "seed": 11}))["choices"]]
    alone = [_ok(api.post("/v1/completions", json={**kw, "seed": 11 + j}))["choices"][0]["text"] for j in range(3)]
    assert many == alone and len(set(alone)) > 1


# ----------------------------------------------------------------------------- streams


def test_a_stream_of_n_choices_ends_each_choice_and_puts_the_stats_on_the_last_chunk(api):
    events = _events(api.post("/v1/completions", json={"prompt": "abc", "n": 3, "max_tokens": 3, "temperature": 1.0,
                                                         "seed": 1, "stream": True, "ignore_eos": True}))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    ends = sorted(c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"] is not None)
    assert ends == [0, 1, 2]
    assert [("specdec" in c) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_the_usage_chunk_has_no_choices_and_counts_the_whole_request(api):
    for path, body in (("/v1/completions", {"prompt": ["abc", "de"]}), ("/v1/chat/completions", {"messages": CHAT})):
        events = _events(api.post(path, json={**body, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
                                              "stream": True, "stream_options": {"include_usage": True}}))
        usage = events[-2]
        assert usage["choices"] == [] and "specdec" in usage
        prompts = 5 if path == "/v1/completions" else 3
        assert usage["usage"]["prompt_tokens"] == prompts
        assert usage["usage"]["total_tokens"] == prompts + usage["usage"]["completion_tokens"]
        assert all("usage" not in e for e in events[:-2])  # only there, without continuous_usage_stats


def test_continuous_usage_counts_tokens_not_pieces(same):
    """With the model drafting for itself each streamed piece brings several tokens: every chunk's
    usage counts its tokens so far, ending at the answer's length."""
    events = _events(same.post("/v1/completions", json={"prompt": "abc", "max_tokens": 12, "temperature": 0, "gamma": 4,
                                                          "ignore_eos": True, "stream": True, "logprobs": 0,
                                                          "stream_options": {"include_usage": True,
                                                                             "continuous_usage_stats": True}}))
    chunks = [e for e in events[:-1] if e["choices"]]
    seen = 0
    for c in chunks:
        lp = c["choices"][0]["logprobs"]
        seen += len(lp["tokens"]) if lp else 0
        assert c["usage"]["completion_tokens"] == seen and c["usage"]["prompt_tokens"] == 3
    assert seen == 12 and any(len(c["choices"][0]["logprobs"]["tokens"]) > 1 for c in chunks if c["choices"][0]["logprobs"])


def _result(logprobs=(), cached=0, tokens=()):
    """The parts of a TextResult that best_of's ranking and the usage read."""
    return SimpleNamespace(logprobs=[(lp, {}) for lp in logprobs], token_ids=list(tokens), prediction_tokens=None,
                           stats=SimpleNamespace(cached_prompt_tokens=cached))


def test_best_of_ranks_a_candidate_without_tokens_last():
    """A candidate that produced no token has no mean log-probability: it ranks below every other
    (however unlikely their tokens), not as a mean of 0, which would beat them all."""
    outs = [_result(), _result([-5.0, -7.0]), _result([-0.5])]
    assert _best(outs, candidates=3, keep=3) == [2, 1, 0]
    assert _best(outs + [_result([-1.0]), _result(), _result([-2.0])], candidates=3, keep=1) == [2, 3]


def test_cached_prompt_tokens_count_once_per_prompt_not_per_choice():
    """With n choices per prompt each choice's run reports the same cached prefix: usage counts it
    once per prompt (the first choice of each), as prompt_tokens are."""
    outs = [_result(cached=8, tokens=[1]), _result(cached=8, tokens=[2, 3]), _result(cached=4), _result(cached=4)]
    usage = _usage(outs, prompt_tokens=20, n=2)
    assert usage["prompt_tokens_details"]["cached_tokens"] == 12 and usage["completion_tokens"] == 3


def test_structured_outputs_json_object_false_asks_for_nothing(api):
    """structured_outputs {"json_object": false} is free text: the answer is the plain one."""
    kw = {"prompt": "abc", "max_tokens": 6, "temperature": 0}
    plain = _ok(api.post("/v1/completions", json=kw))
    off = _ok(api.post("/v1/completions", json={**kw, "structured_outputs": {"json_object": False}}))
    assert off["choices"][0]["text"] == plain["choices"][0]["text"]


def _stat(**kw):
    base = dict(target_calls=2, generated_tokens=4, draft_tokens_proposed=4, draft_tokens_accepted=2, tree_rounds=0,
                wall_s=0.5, method="greedy", lossless=True, drafter="tiny", gamma_policy="fixed")
    return SimpleNamespace(stats=SimpleNamespace(**{**base, **kw}))


def test_the_specdec_stats_sum_every_choices_counters():
    """The response's ``specdec`` object is the whole request's: counters and wall time summed over
    its choices, lossless only where every choice was (a pure function of the choices' stats)."""
    st = _stats([_stat(tree_rounds=1, wall_s=0.25), _stat(tree_rounds=2, wall_s=0.5, lossless=False), _stat(tree_rounds=3)])
    assert st["tree_rounds"] == 6 and st["wall_s"] == 1.25 and st["lossless"] is False
    assert st["target_calls"] == 6 and st["draft_tokens_proposed"] == 12 and st["draft_tokens_accepted"] == 6
    assert st["tokens_per_target_call"] == 2.0 and st["acceptance_rate"] == 0.5


def test_echo_logprobs_and_prompt_logprobs_each_get_their_own_count_of_best_tokens(api):
    """With echo + logprobs 1 and prompt_logprobs 3 the prompt is scored once, keeping the larger
    count: the echoed logprobs carry 1 best token (+ the prompt's own) per position, prompt_logprobs 3."""
    out = _ok(api.post("/v1/completions", json={"prompt": "abcdef", "max_tokens": 0, "echo": True, "logprobs": 1,
                                                  "prompt_logprobs": 3}))
    choice = out["choices"][0]
    assert choice["prompt_logprobs"][0] is None
    assert all(len(at) >= 3 for at in choice["prompt_logprobs"][1:])
    assert all(1 <= len(top) <= 2 for top in choice["logprobs"]["top_logprobs"][1:])


def test_a_refused_option_sent_off_is_accepted_and_named_ignored(api):
    """vLLM clients send ``use_beam_search: false`` by default: a refused option that asks for
    nothing (false, null, [] or {}) is accepted and named in the ignored-fields header, not a 400."""
    kw = {"prompt": "abc", "max_tokens": 2, "temperature": 0}
    for off in ({"use_beam_search": False}, {"logits_processors": []}, {"audio": None}, {"web_search_options": {}}):
        r = api.post("/v1/completions", json={**kw, **off})
        _ok(r)
        assert list(off) == [f.strip() for f in r.headers["x-specdec-ignored-fields"].split(",")]


def _scored(*logprobs):
    """The part of a TextResult best_of's ranking reads."""
    return SimpleNamespace(logprobs=[(lp, {}) for lp in logprobs])


def test_best_of_breaks_ties_in_run_order():
    """Candidates with the same mean log-probability keep their run order (the first run wins a tie)."""
    outs = [_scored(-2.0), _scored(-1.0), _scored(-1.0, -1.0), _scored(-0.5, -1.5)]
    assert _best(outs, candidates=4, keep=4) == [1, 2, 3, 0]
    assert _best(outs, candidates=2, keep=1) == [1, 2]


def test_the_default_max_tokens_is_cut_to_the_room_the_prompt_leaves(api):
    """Without max_tokens a completion asks for 16 tokens, or fewer where the prompt leaves less
    room in the context: an answer to the end of the context, not a 400."""
    out = _ok(api.post("/v1/completions", json={"prompt": [0] * (CONTEXT - 4), "temperature": 0, "ignore_eos": True}))
    assert out["usage"]["completion_tokens"] == 4 and out["choices"][0]["finish_reason"] == "length"


@pytest.fixture(scope="module")
def short_default():
    """The tiny model behind a server whose --default-max-tokens is 8."""
    model = tiny_native(vocab=VOCAB, max_length=CONTEXT)
    app = create_app(model, tokenizer=ChatLetters(), settings=ServerSettings(model_name="tiny", default_max_tokens=8),
                     drafter_factory=lambda: ModelDrafter(model), drafter_name="self")
    with TestClient(app, base_url="http://localhost") as c:
        yield c


def test_chat_truncation_to_the_context_leaves_room_for_the_default_answer(short_default):
    """Chat with truncate_prompt_tokens -1 and no max_tokens keeps as much of the conversation as
    leaves room for the server's default answer (8 tokens here), which is then generated in full."""
    out = _ok(short_default.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "b" * (2 * CONTEXT)}], "truncate_prompt_tokens": -1,
        "temperature": 0, "ignore_eos": True}))
    assert out["usage"]["prompt_tokens"] == CONTEXT - 8 and out["usage"]["completion_tokens"] == 8


def test_continue_final_message_continues_the_last_message_not_an_earlier_copy(api):
    """continue_final_message cuts the rendered conversation after the *last* message's text, even
    where an earlier message has the same text (ChatLetters renders a conversation as its letters)."""
    out = _ok(api.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ab"}],
        "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 1, "temperature": 0}))
    assert out["usage"]["prompt_tokens"] == 4


def test_detokenize_takes_the_last_token_of_the_vocabulary_and_refuses_the_next(api):
    assert _ok(api.post("/detokenize", json={"tokens": [0, VOCAB - 1]}))["prompt"] == "az"
    assert "outside the vocabulary" in _bad(api.post("/detokenize", json={"tokens": [0, VOCAB]}))["message"]


def test_a_refused_option_with_any_other_value_is_a_400_naming_it(api):
    """Only null, false, [] and {} count as "not asked for": anything else sent for a refused
    option (an empty string too) is a 400 that names it, never silently dropped."""
    for field, value in (("functions", ""), ("use_beam_search", True), ("guided_whitespace_pattern", " ")):
        r = api.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, field: value})
        err = _bad(r)
        assert err["param"] == field and f"{field} is not supported" in err["message"]


def test_a_request_refused_for_kv_room_gives_its_generation_slot_back():
    """A completion whose KV claim does not fit the server's KV budget is a 503, and the generation
    slot it took first is given back: on a server of one slot the next (small) request is answered,
    not refused with a 429."""
    model = tiny_native(vocab=VOCAB, max_length=1024)

    def app(**settings):
        return create_app(model, tokenizer=ChatLetters(), settings=ServerSettings(model_name="tiny", **settings),
                          drafter_factory=lambda: ModelDrafter(model), drafter_name="self")

    ctx = app().state.ctx
    per_position = ctx.kv_per_position + ctx.draft_kv_per_position  # what a request claims per position
    assert per_position > 0
    small = {"prompt": "abc", "max_tokens": 2, "temperature": 0}
    with TestClient(app(max_active_requests=1, max_kv_bytes=300 * per_position), base_url="http://localhost") as c:
        for _ in range(2):
            assert _bad(c.post("/v1/completions", json={**small, "max_tokens": 800}), 503)["message"]
        _ok(c.post("/v1/completions", json=small))


def test_a_prompt_token_one_past_the_vocabulary_is_named_in_the_400(api):
    """A token-id prompt is checked against the vocabulary before anything runs: the 400 names the
    token's position and the vocabulary's range."""
    err = _bad(api.post("/v1/completions", json={"prompt": [0, 1, VOCAB], "max_tokens": 2}))
    assert f"prompt token 2 = {VOCAB} is outside the vocabulary [0, {VOCAB})" in err["message"]
    _ok(api.post("/v1/completions", json={"prompt": [0, 1, VOCAB - 1], "max_tokens": 2, "temperature": 0}))


def test_chat_logprobs_of_impossible_tokens_are_floored_at_minus_9999(api):
    """Under top_k 1 every other token's log-probability is -inf: chat logprobs report it as
    -9999.0 (JSON has no infinity), streamed or not, never an error."""
    body = {"messages": CHAT, "max_tokens": 3, "temperature": 1.0, "seed": 0, "top_k": 1, "logprobs": True,
            "top_logprobs": 3}
    content = _ok(api.post("/v1/chat/completions", json=body))["choices"][0]["logprobs"]["content"]
    streamed = [e["choices"][0]["logprobs"] for e in _events(api.post("/v1/chat/completions", json={**body, "stream": True}))[:-1]
                if e["choices"] and e["choices"][0]["logprobs"]]
    for entries in (content, [x for lp in streamed for x in lp["content"]]):
        assert len(entries) == 3
        for e in entries:
            assert e["logprob"] == 0.0 and [t["logprob"] for t in e["top_logprobs"]][1:] == [-9999.0, -9999.0]


def test_min_tokens_past_max_tokens_is_a_400_that_names_min_tokens(api):
    """min_tokens one past max_tokens is refused by the endpoint itself: OpenAI's error names the
    field (``param``) and the limit."""
    err = _bad(api.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "min_tokens": 5}))
    assert err["param"] == "min_tokens" and "must not exceed max_tokens (4)" in err["message"]
    err = _bad(api.post("/v1/chat/completions", json={"messages": CHAT, "max_completion_tokens": 3, "min_tokens": 4}))
    assert err["param"] == "min_tokens" and "must not exceed max_tokens (3)" in err["message"]


def test_a_spare_slot_without_kv_room_gives_its_generation_slot_back():
    """On a batching server a request's second choice takes a spare slot only where its KV claim
    fits; where it does not, the slot it took is given back: on a server of two slots whose KV
    budget holds one choice, requests of n=2 run one after the other, and once they end both slots are free."""
    model = tiny_native(vocab=VOCAB, max_length=CONTEXT)

    def app(**settings):
        return create_app(model, tokenizer=ChatLetters(), settings=ServerSettings(model_name="tiny", **settings),
                          drafter_factory=lambda: ModelDrafter(model), drafter_name="self")

    ctx = app().state.ctx
    per_choice = (ctx.kv_per_position + ctx.draft_kv_per_position) * CONTEXT  # a choice's claim: the whole context
    assert per_choice > 0
    body = {"prompt": "abc", "max_tokens": 2, "temperature": 0, "n": 2}
    served = app(max_active_requests=2, max_kv_bytes=per_choice * 3 // 2)
    with TestClient(served, base_url="http://localhost") as c:
        for _ in range(4):
            assert len(_ok(c.post("/v1/completions", json=body))["choices"]) == 2
        slots = served.state.ctx.active
        free = [slots.acquire(blocking=False) for _ in range(2)]  # every slot given back
        for taken in free:
            if taken:
                slots.release()
        assert free == [True, True]


def test_a_greedy_only_method_with_sampling_is_refused_before_a_stream_begins(api):
    """A verification rule that needs temperature 0 (greedy) asked for with sampling is checked
    with the request: a streamed request gets an HTTP 400 that says so, not a 200 stream whose
    only event is the error."""
    for stream in (False, True):
        r = api.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "method": "greedy", "temperature": 1.0,
                                              "stream": stream})
        assert "method 'greedy' needs temperature 0" in _bad(r)["message"]


def test_streamed_echo_offsets_continue_after_the_echoed_prompt(api):
    """Streamed with echo and logprobs, the first generated token's text_offset is where the echoed
    prompt ends (offsets count the choice's whole text), as the non-streamed answer has it."""
    body = {"prompt": "abcd", "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 0, "ignore_eos": True}
    whole = _ok(api.post("/v1/completions", json=body))["choices"][0]["logprobs"]["text_offset"]
    chunks = [e for e in _events(api.post("/v1/completions", json={**body, "stream": True}))[:-1] if e["choices"]]
    offsets = [o for c in chunks if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole == list(range(8))


def test_continuous_usage_counts_each_choices_own_prompt(api):
    """With several prompts, each chunk's continuous usage counts the prompt of its own choice."""
    events = _events(api.post("/v1/completions", json={
        "prompt": ["abc", "de"], "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    chunks = [e for e in events[:-1] if e["choices"]]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}
    for c in chunks:
        assert c["usage"]["prompt_tokens"] == (3 if c["choices"][0]["index"] == 0 else 2)


def test_ignored_fields_are_named_in_the_server_log(api, caplog):
    """Fields accepted without effect are named in the response header and in the server's log."""
    with caplog.at_level("WARNING", logger="specdec.server"):
        r = api.post("/v1/completions", json={"prompt": "abc", "max_tokens": 1, "temperature": 0, "frobnicate": 1})
    _ok(r)
    assert r.headers["x-specdec-ignored-fields"] == "frobnicate"
    assert any("ignored request fields: frobnicate" in rec.getMessage() for rec in caplog.records)


def _local_greedy(prompt: str, max_tokens: int, **sampling) -> str:
    """The tiny target of ``api`` decoding greedily on its own (no server, no drafter): the reference."""
    model = tiny_native(vocab=VOCAB, max_length=CONTEXT)
    engine = Engine(LoadedModel("tiny", model, ChatLetters(), None, "local", frozenset()), None, "none")
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=max_tokens, **sampling)
    return engine.generate(ChatLetters().encode(prompt), cfg, ignore_eos=True).text


def test_frequency_and_presence_penalties_each_reach_the_sampler_as_themselves(api):
    """frequency_penalty scales with a token's count, presence_penalty is flat: each request field is
    the sampler's own (the server's greedy answer is the target's own greedy answer under it)."""
    kw = {"prompt": "abc", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    freq = _ok(api.post("/v1/completions", json={**kw, "frequency_penalty": 0.5}))["choices"][0]["text"]
    pres = _ok(api.post("/v1/completions", json={**kw, "presence_penalty": 0.5}))["choices"][0]["text"]
    ref_freq, ref_pres = _local_greedy("abc", 24, frequency_penalty=0.5), _local_greedy("abc", 24, presence_penalty=0.5)
    assert ref_freq != ref_pres  # the prompt tells the two apart
    assert (freq, pres) == (ref_freq, ref_pres)


def test_a_single_stop_string_is_one_string_not_its_characters(api):
    """``stop: "xy"`` (a string, not a list) stops at "xy" only: an answer holding x or y alone is not cut."""
    kw = {"prompt": "abc", "max_tokens": 24, "temperature": 1.0, "seed": 0, "ignore_eos": True}
    plain = _ok(api.post("/v1/completions", json=kw))["choices"][0]["text"]
    a, b = plain[0], plain[1]  # plain[:2] ends the answer; a string of its two letters swapped does not occur
    swapped = b + a
    assert swapped not in plain and a != b
    out = _ok(api.post("/v1/completions", json={**kw, "stop": swapped}))["choices"][0]
    assert out["text"] == plain and out["finish_reason"] == "length"
    cut = _ok(api.post("/v1/completions", json={**kw, "stop": plain[2:4]}))["choices"][0]
    assert cut["text"] == plain[:2] and cut["finish_reason"] == "stop"


def test_a_logit_bias_key_that_is_not_a_whole_token_id_is_a_400(api):
    """logit_bias keys are token ids: "1.5" (or "1.0") is refused naming logit_bias, never rounded to a token."""
    for key in ("1.5", "1.0"):
        err = _bad(api.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "logit_bias": {key: 5}}))
        assert err["param"] == "logit_bias" and "token ids" in err["message"]


def test_a_regex_or_grammar_response_format_without_its_text_is_a_400(api):
    """response_format regex / grammar needs a non-empty string: an empty one is a 400 naming it."""
    for kind in ("regex", "grammar"):
        err = _bad(api.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2,
                                                     "response_format": {"type": kind, kind: ""}}))
        assert err["param"] == "response_format" and f"needs a non-empty string field '{kind}'" in err["message"]


def test_a_guided_choice_with_an_empty_choice_is_a_400_naming_the_field(api):
    for body in ({"guided_choice": ["yes", ""]}, {"structured_outputs": {"choice": ["", "no"]}}):
        err = _bad(api.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, **body}))
        name = next(iter(body)) if "guided_choice" in body else "structured_outputs.choice"
        assert err["param"] == name and "non-empty strings" in err["message"]


def test_structured_outputs_backend_only_keys_are_accepted_and_change_nothing(api):
    """structured_outputs.disable_fallback picks vLLM's backend: accepted (even true), the answer the plain one."""
    kw = {"prompt": "abc", "max_tokens": 6, "temperature": 0}
    plain = _ok(api.post("/v1/completions", json=kw))["choices"][0]["text"]
    out = _ok(api.post("/v1/completions", json={**kw, "structured_outputs": {"disable_fallback": True}}))
    assert out["choices"][0]["text"] == plain
    err = _bad(api.post("/v1/completions", json={**kw, "structured_outputs": {"backend": "xgrammar"}}))
    assert err["param"] == "structured_outputs.backend"


def test_chat_refuses_continue_final_message_with_a_generation_prompt(api):
    err = _bad(api.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "continue_final_message": True}))
    assert "add_generation_prompt false" in err["message"]


@pytest.mark.parametrize("own", ["messages", "tools", "add_generation_prompt", "tokenize", "chat_template"])
def test_chat_template_kwargs_may_not_set_the_renderings_own_arguments(api, own):
    err = _bad(api.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1,
                                                      "chat_template_kwargs": {own: True}}))
    assert f"chat_template_kwargs may not set {own}" in err["message"]


def test_chat_max_completion_tokens_zero_is_a_400(api):
    """Chat has no echo: max_completion_tokens (as max_tokens) must be at least 1."""
    for field in ("max_tokens", "max_completion_tokens"):
        assert _bad(api.post("/v1/chat/completions", json={"messages": CHAT, field: 0}))["param"] == field


def test_top_logprobs_without_logprobs_is_a_400_and_logprobs_alone_give_no_alternatives(api):
    assert "top_logprobs needs logprobs" in _bad(api.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 2, "top_logprobs": 2}))["message"]
    content = _ok(api.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 3, "temperature": 0,
                                                          "ignore_eos": True, "logprobs": True}))["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(e["top_logprobs"] == [] for e in content)


def test_streamed_return_token_ids_send_each_choices_prompt_ids_once(api):
    """vLLM's return_token_ids streamed: a choice's first chunk carries its prompt's ids, later ones only their new ids."""
    events = _events(api.post("/v1/completions", json={"prompt": ["abc", "de"], "max_tokens": 3, "temperature": 0,
                                                         "ignore_eos": True, "stream": True, "return_token_ids": True}))
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    for index, prompt in ((0, [0, 1, 2]), (1, [3, 4])):
        mine = [c for c in chunks if c["index"] == index]
        assert [c.get("prompt_token_ids") for c in mine] == [prompt] + [None] * (len(mine) - 1)
        assert sum(len(c["token_ids"]) for c in mine) == 3


def test_continuous_usage_of_a_choices_last_chunk_counts_its_whole_answer(api):
    """With continuous usage, a choice's final chunk counts every token of its answer, the stop
    token that ended it too (which brings no text), as the request's usage does: here the answer is
    its first token alone, a stop token."""
    plain = _ok(api.post("/v1/completions", json={"prompt": "abc", "max_tokens": 6, "temperature": 0}))
    stop = ord(plain["choices"][0]["text"][0]) - ord("a")
    body = {"prompt": "abc", "max_tokens": 6, "temperature": 0, "stop_token_ids": [stop], "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = _events(api.post("/v1/completions", json=body))
    final = [e for e in events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]][-1]
    total = events[-2]["usage"]
    assert final["choices"][0]["text"] == "" and final["choices"][0]["finish_reason"] == "stop"
    assert final["usage"]["completion_tokens"] == total["completion_tokens"] == 1


def test_a_spare_slot_refused_for_want_of_a_generation_slot_gives_its_spare_permit_back():
    """_spare_slot takes a spare permit, then a generation slot, then KV room: where the generation
    slot is not free, the spare permit goes back (else spare slots leak until none is ever taken)."""
    spare, active = threading.Semaphore(1), threading.Semaphore(0)
    store = SimpleNamespace(try_claim=lambda n: True)
    job = SimpleNamespace(ctx=SimpleNamespace(spare=spare, active=active, store=store), kv_bytes=1)
    assert _spare_slot(job) is False
    assert spare.acquire(blocking=False)  # given back


def test_each_prompts_seeded_choices_count_their_rank_from_the_request_seed(api):
    """With several prompts and n choices, choice j of every prompt uses seed + j (its rank among
    that prompt's choices), not seed + its index in the response."""
    kw = {"max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    many = [c["text"] for c in _ok(api.post("/v1/completions", json={**kw, "prompt": ["abc", "de"], "n": 2, "seed": 11}))["choices"]]
    alone = [_ok(api.post("/v1/completions", json={**kw, "prompt": p, "seed": 11 + j}))["choices"][0]["text"]
             for p in ("abc", "de") for j in range(2)]
    other = [_ok(api.post("/v1/completions", json={**kw, "prompt": "de", "seed": 11 + j}))["choices"][0]["text"] for j in (2, 3)]
    assert many == alone and other != alone[2:]  # seeds 13, 14 would answer otherwise


class _StrippingLetters(ChatLetters):
    """A template that strips each message's surrounding white space and ends each turn with "z"."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **_):
        return "".join(m["content"].strip() + "z" for m in messages)


def test_continue_final_message_finds_a_last_message_the_template_stripped():
    """continue_final_message with a template that strips the message (" ab " rendered as "ab"):
    the conversation is cut after the stripped text, its end of turn left out, not refused."""
    model = tiny_native(vocab=VOCAB, max_length=CONTEXT)
    app = create_app(model, tokenizer=_StrippingLetters(), settings=ServerSettings(model_name="tiny"),
                     drafter_factory=lambda: ModelDrafter(model), drafter_name="self")
    with TestClient(app, base_url="http://localhost") as c:
        body = {"messages": [{"role": "user", "content": "c"}, {"role": "assistant", "content": " ab "}],
                "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 1, "temperature": 0}
        out = _ok(c.post("/v1/chat/completions", json=body))
        assert out["usage"]["prompt_tokens"] == 4  # "czab": the final "z" cut
        tokens = _ok(c.post("/tokenize", json={k: body[k] for k in ("messages", "continue_final_message", "add_generation_prompt")}))
        assert tokens["tokens"] == [2, 25, 0, 1]
