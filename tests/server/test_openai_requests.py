"""The OpenAI endpoints' request validation, usage / finish_reason bookkeeping and
stream assembly, run in-process on a tiny native model with the letter tokenizer (token i <-> the
letter 'a' + i), so each test takes well under a second."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from specdec.drafters import ModelDrafter
from specdec.server import ServerSettings, create_app
from specdec.server.openai_api import _best, _usage
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
