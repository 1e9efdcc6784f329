"""The OpenAI-compatible endpoints, driven by the official ``openai`` client against ``specdec serve``.

The server process serves the bundled 15.7 M-parameter SmolLM2 draft as its target (fast on a CPU)
with itself as drafter; greedy answers must equal local speculative decoding with the same γ.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from serverproc import DRAFT_MODEL, OPENAI_KEY
from specdec.engine import Engine, EngineConfig
from specdec.models import registry
from specdec.sampling import SamplingConfig

MODEL = DRAFT_MODEL
KEY = OPENAI_KEY
PROMPT = "def add(a, b):"


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def local():
    return Engine.build(EngineConfig(target=MODEL, draft=MODEL, dtype="float32"))


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def test_models(client, server, local):
    assert [m.id for m in client.models.list().data] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["max_model_len"] == local.target.model.max_length
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.models.retrieve("gpt-4")

    from specdec import __version__

    assert httpx.get(server.url + "/version", timeout=60).json() == {"version": __version__}  # open, as /health is


def test_completion_plain_and_streaming(client, local):
    ref = local.generate(PROMPT, SamplingConfig(temperature=0.0, max_new_tokens=24), gamma=4)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    choice = out.choices[0]
    assert choice.text == ref.text and choice.finish_reason == ("length" if len(ref.token_ids) == 24 else "stop")
    assert out.usage.prompt_tokens == len(ref.prompt_ids) and out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.model_extra["specdec"]["method"] == "greedy" and out.model_extra["specdec"]["lossless"] is True
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids) and chunks[-1].choices == []


def test_chat_plain_and_streaming(client):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Write a Python hello world."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content and out.usage.completion_tokens <= 20
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason


def test_continuous_usage_in_every_chunk(client):
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk carries its choice's usage so far
    (prompt tokens, the tokens streamed until then), growing to the choice's count at its end; the
    final usage chunk totals the choices.  Completions with two prompts, and chat (role chunk first)."""
    prompts = [PROMPT, "The capital of France is"]
    kw = dict(model=MODEL, max_tokens=16, temperature=0, stream=True,
              stream_options={"include_usage": True, "continuous_usage_stats": True})
    whole = client.completions.create(model=MODEL, prompt=prompts, max_tokens=16, temperature=0)
    chunks = list(client.completions.create(prompt=prompts, **kw, extra_body={"return_token_ids": True}))
    for choice in whole.choices:
        mine = [c for c in chunks if c.choices and c.choices[0].index == choice.index]
        counts = [c.usage.completion_tokens for c in mine]
        assert counts == sorted(counts) and counts[-1] > 0
        streamed = 0
        for c in mine:  # each chunk's count is the tokens streamed up to and including it
            streamed += len(c.choices[0].model_extra.get("token_ids") or ())
            assert c.usage.completion_tokens == streamed and c.usage.total_tokens == c.usage.prompt_tokens + streamed
        assert {c.usage.prompt_tokens for c in mine} == {len(mine[0].choices[0].model_extra["prompt_token_ids"])}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == sum(
        max(c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1))
    messages = [{"role": "user", "content": "Write a Python hello world."}]
    said = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(messages=messages, **kw))
    assert all(c.usage is not None for c in chunks) and chunks[0].usage.completion_tokens == 0  # the role chunk
    assert [c.usage.completion_tokens for c in chunks[:-1]][-1] == said.usage.completion_tokens == chunks[-1].usage.completion_tokens
    plain = list(client.chat.completions.create(messages=messages, **{**kw, "stream_options": {"include_usage": True}}))
    assert all(c.usage is None for c in plain[:-1])  # only with continuous_usage_stats


def test_truncate_prompt_tokens_reads_the_prompts_last_tokens(client, local):
    """vLLM's ``truncate_prompt_tokens``: only the last k prompt tokens are read, as if they were the
    prompt (echo shows them); -1 keeps what the context holds; 0 and more than the context are 400s."""
    text = "The quick brown fox jumps over the lazy dog. " * 3
    full = local.target.tokenizer.encode(text, add_special_tokens=False)
    kw = dict(model=MODEL, max_tokens=8, temperature=0)
    cut = client.completions.create(prompt=text, **kw, extra_body={"truncate_prompt_tokens": 5, "return_token_ids": True})
    assert cut.choices[0].model_extra["prompt_token_ids"] == full[-5:] and cut.usage.prompt_tokens == 5
    assert cut.choices[0].text == client.completions.create(prompt=full[-5:], **kw).choices[0].text
    echoed = client.completions.create(prompt=text, echo=True, **kw, extra_body={"truncate_prompt_tokens": 5})
    assert echoed.choices[0].text == local.target.tokenizer.decode(full[-5:]) + cut.choices[0].text
    assert client.completions.create(prompt=text, **kw, extra_body={"truncate_prompt_tokens": -1}).usage.prompt_tokens == len(full)
    said = client.chat.completions.create(messages=[{"role": "user", "content": text}], **kw, extra_body={"truncate_prompt_tokens": 4})
    assert said.usage.prompt_tokens == 4
    for bad in (0, local.target.model.max_length + 1):
        with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
            client.completions.create(prompt=text, **kw, extra_body={"truncate_prompt_tokens": bad})


def test_a_prediction_drafts_for_free_and_changes_no_token(client, local):
    """OpenAI's Predicted Outputs: with the answer itself as the prediction, a greedy chat answer
    comes in fewer target calls, token for token the same; a wrong prediction changes
    nothing either; seeded sampling gives plain seeded sampling's tokens whatever the prediction;
    completions take it too; a malformed one is a 400."""
    msgs = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=48, temperature=0)
    plain = client.chat.completions.create(**kw)
    answer = plain.choices[0].message.content
    guessed = client.chat.completions.create(**kw, extra_body={"prediction": {"type": "content", "content": answer}})
    assert guessed.choices[0].message.content == answer and guessed.model_extra["specdec"]["drafter"].startswith("prediction+")
    # (this server's drafter is the target itself, accepted whole; how long the free drafts are is the
    # cost controller's and the server's load cap's call, which read timings: never more calls, often fewer)
    assert guessed.model_extra["specdec"]["target_calls"] <= plain.model_extra["specdec"]["target_calls"]
    # usage: the prediction's tokens the answer took, and the rest of it (none asked: no such fields)
    size = len(local.target.tokenizer.encode(answer, add_special_tokens=False))
    took = guessed.usage.completion_tokens_details
    assert took.accepted_prediction_tokens + took.rejected_prediction_tokens == size
    assert took.accepted_prediction_tokens >= size - 2, took  # the answer is the prediction (its text re-tokenised)
    assert plain.usage.completion_tokens_details is None or plain.usage.completion_tokens_details.accepted_prediction_tokens is None
    parts = {"type": "content", "content": [{"type": "text", "text": "Nothing like "}, {"type": "text", "text": "the answer."}]}
    wrong = client.chat.completions.create(**kw, extra_body={"prediction": parts})
    assert wrong.choices[0].message.content == answer
    assert wrong.usage.completion_tokens_details.accepted_prediction_tokens == 0
    assert wrong.usage.completion_tokens_details.rejected_prediction_tokens > 0
    seeded = dict(kw, temperature=1.0, seed=11)
    sampled = client.chat.completions.create(**seeded).choices[0].message.content
    again = client.chat.completions.create(**seeded, extra_body={"prediction": {"type": "content", "content": answer}})
    assert again.choices[0].message.content == sampled
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"prediction": {"type": "content", "content": text}})
    assert out.choices[0].text == text and out.model_extra["specdec"]["target_calls"] < 10
    with pytest.raises(openai.BadRequestError, match="prediction"):
        client.chat.completions.create(**kw, extra_body={"prediction": {"type": "text", "content": answer}})


def test_sampling_options_stop_and_seed(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.9, top_p=0.95, seed=7)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw, extra_body={"top_k": 50, "repetition_penalty": 1.1, "method": "coupled"})
    assert a == client.completions.create(**kw).choices[0].text  # a fixed seed repeats itself
    assert b.model_extra["specdec"]["method"] == "coupled"
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=["\n"])
    assert "\n" not in out.choices[0].text and out.choices[0].finish_reason == "stop"


def test_errors_come_back_as_openai_errors(client, server):
    with pytest.raises(openai.BadRequestError, match="best_of") as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, n=3, best_of=2)
    assert (caught.value.param, caught.value.code) == ("best_of", "400")  # as the client reads them
    with pytest.raises(openai.BadRequestError, match="cannot be streamed"):
        client.completions.create(model=MODEL, prompt=PROMPT, n=1, best_of=3, stream=True)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100_000)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError, match="functions is not supported"):  # the older spelling of tools
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       functions=[{"name": "f", "parameters": {"type": "object"}}])
    with pytest.raises(openai.BadRequestError, match="logit_bias token"):
        client.completions.create(model=MODEL, prompt=PROMPT, logit_bias={"99999999": 5})
    with pytest.raises(openai.BadRequestError, match="temperature") as caught:  # 400, as OpenAI answers it
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=2.5)  # OpenAI's bound is 2
    assert caught.value.param == "temperature"
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError, match="API key"):
            bad.models.list()


def test_unknown_fields_are_accepted_ignored_and_named(client):
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        store=False, parallel_tool_calls=False, user="someone", metadata={"k": "v"}, extra_body={"frobnicate": 1},
    )
    ignored = {f.strip() for f in raw.headers["x-specdec-ignored-fields"].split(",")}
    assert {"store", "parallel_tool_calls", "user", "metadata", "frobnicate"} <= ignored
    assert raw.parse().choices[0].message.content is not None
    # a field this server refuses, sent empty on completions (no tools there): accepted, and named too
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"tools": []})
    assert "tools" in {f.strip() for f in raw.headers["x-specdec-ignored-fields"].split(",")}


def test_a_seed_repeats_itself_with_gamma_auto_and_equals_plain_sampling(client, local):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0.8, top_p=0.9, seed=1,
              extra_body={"gamma": "auto"})
    texts = {client.completions.create(**kw).choices[0].text for _ in range(3)}
    plain = Engine(local.target, None, "none").generate(
        "Once upon a time", SamplingConfig(temperature=0.8, top_p=0.9, seed=1, max_new_tokens=24))
    assert texts == {plain.text}


def test_logprobs_are_the_targets_processed_law(client, local):
    cfg = SamplingConfig(temperature=0.7, top_k=40, seed=5, max_new_tokens=12)
    ref = local.generate(PROMPT, cfg, gamma=4, logprobs=3)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.7, seed=5, logprobs=3,
                                    extra_body={"top_k": 40})
    lp = out.choices[0].logprobs
    assert out.choices[0].text == ref.text and len(lp.token_logprobs) == len(ref.token_ids)
    assert lp.token_logprobs == pytest.approx([max(v, -9999.0) for v, _ in ref.logprobs], abs=1e-9)
    # the sampled token's entry is always there, as OpenAI's legacy completions report it (up to logprobs + 1)
    assert all(3 <= len(top) <= 4 and top[t] == v for top, t, v in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))
    assert any(len(top) == 4 for top in lp.top_logprobs)  # T = 0.7: a token outside the best three was drawn
    one = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.7, seed=5, logprobs=0,
                                    extra_body={"top_k": 40}).choices[0].logprobs
    assert one.top_logprobs == [{t: v} for t, v in zip(one.tokens, one.token_logprobs)]  # logprobs 0: the token alone
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=6,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content  # the end-of-turn token left out
    assert all(len(c.top_logprobs) == 2 and c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)  # greedy


def test_text_offsets_count_characters_where_tokens_hold_parts_of_them(client):
    """``text_offset`` with characters that several tokens spell (emoji, CJK): each token's offset is
    the character its bytes start in, so the offsets never run backwards nor past the text, echoed
    prompt and answer alike (they had counted each partial token's U+FFFD as a character)."""
    for prompt in ("Emojis: \U0001F600\U0001F389\U0001F525\U0001F680", "\u4f60\u597d\u4e16\u754c\uff0c\u4eca\u5929"):
        for echo in (True, False):
            choice = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=1,
                                               echo=echo).choices[0]
            offsets = choice.logprobs.text_offset
            assert offsets == sorted(offsets) and offsets[-1] < len(choice.text), (prompt, echo, offsets, choice.text)


def test_streamed_logprobs_come_with_their_text(client):
    """In a stream each chunk carries the log-probabilities of the tokens its text completes (as
    OpenAI's and vLLM's streams do), not all of them at the end; together they are the same as the
    answer's without a stream, and the tokens so far never run ahead of the text so far."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.7, seed=5, logprobs=2, echo=False)
    whole = client.completions.create(**kw).choices[0].logprobs
    chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert sum(1 for c in chunks if c.choices[0].text and c.choices[0].logprobs) >= 3
    assert [t for p in parts for t in p.tokens] == whole.tokens
    assert [v for p in parts for v in p.token_logprobs] == pytest.approx(whole.token_logprobs, abs=1e-9)
    assert [o for p in parts for o in p.text_offset] == whole.text_offset
    assert [t for p in parts for t in p.top_logprobs] == whole.top_logprobs
    text = tokens = ""
    for c in chunks:
        text += c.choices[0].text
        tokens += "".join(c.choices[0].logprobs.tokens) if c.choices[0].logprobs else ""
        assert text.startswith(tokens) or c.choices[0].finish_reason is not None
    messages = [{"role": "user", "content": "Write a Python hello world."}]
    chat = dict(model=MODEL, messages=messages, max_tokens=20, temperature=0, logprobs=True, top_logprobs=2)
    answer = client.chat.completions.create(**chat).choices[0]
    streamed = [c.choices[0] for c in client.chat.completions.create(**chat, stream=True) if c.choices]
    entries = [e for c in streamed if c.logprobs is not None for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in answer.logprobs.content]
    assert sum(1 for c in streamed if c.delta.content and c.logprobs) >= 2
    assert "".join(e.token for e in entries) == "".join(c.delta.content or "" for c in streamed)


def test_logprob_bytes_are_each_tokens_own_and_join_to_the_text(client, local):
    """Chat logprobs' ``bytes`` are each token's own bytes, as OpenAI reports them: a token that
    holds part of a character (SmolLM2 splits the emoji and each CJK character over several) is
    that part, not U+FFFD's three bytes, so the entries' bytes join to the message's UTF-8."""
    text = "😀 你好"
    tok = local.target.tokenizer
    assert any("\ufffd" in tok.decode([t]) for t in tok.encode(text, add_special_tokens=False))  # split characters
    for body in ({}, {"return_tokens_as_token_ids": True}):
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Smile."}], max_tokens=12,
                                             temperature=0, logprobs=True, top_logprobs=1,
                                             extra_body={"guided_choice": [text], **body}).choices[0]
        assert out.message.content == text
        entries = out.logprobs.content
        assert b"".join(bytes(e.bytes) for e in entries) == text.encode("utf-8")
        assert all(bytes(e.top_logprobs[0].bytes) == bytes(e.bytes) for e in entries)  # greedy: the token is the top one


def test_vllms_token_id_options(client, local):
    """vLLM's ``return_tokens_as_token_ids`` (logprobs name tokens ``token_id:N``; offsets and bytes
    stay the text's) and ``return_token_ids`` (the prompt's and each choice's token ids; in a stream,
    each chunk's new ids, which join to the whole answer's, end-of-turn token included)."""
    tok = local.target.tokenizer
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.7, seed=5, logprobs=2)
    named = client.completions.create(**kw).choices[0]
    ids = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True}).choices[0]
    assert ids.text == named.text and ids.model_extra["prompt_token_ids"] == tok.encode(PROMPT, add_special_tokens=False)
    generated = ids.model_extra["token_ids"]
    assert tok.decode(generated) == named.text and len(generated) == len(named.logprobs.tokens)
    assert ids.logprobs.tokens == [f"token_id:{t}" for t in generated]
    assert ids.logprobs.text_offset == named.logprobs.text_offset and ids.logprobs.token_logprobs == named.logprobs.token_logprobs
    for top_ids, top_named in zip(ids.logprobs.top_logprobs, named.logprobs.top_logprobs):
        assert all(k.startswith("token_id:") and k[9:].isdigit() for k in top_ids)
        assert sorted(top_ids.values()) == sorted(top_named.values())
        assert sorted(tok.decode([int(k[9:])]) for k in top_ids) == sorted(top_named)
    chunks = [c.choices[0] for c in client.completions.create(**kw, n=2, stream=True, extra_body={
        "return_tokens_as_token_ids": True, "return_token_ids": True}) if c.choices]
    for index in (0, 1):
        mine = [c for c in chunks if c.index == index]
        assert [c.model_extra.get("prompt_token_ids") is not None for c in mine].count(True) == 1
        assert mine[0].model_extra["prompt_token_ids"] == ids.model_extra["prompt_token_ids"]
        streamed = [t for c in mine for t in c.model_extra["token_ids"]]
        assert [t for c in mine if c.logprobs for t in c.logprobs.tokens] == [f"token_id:{t}" for t in streamed]
        if index == 0:  # seed + 0: the same answer as without a stream
            assert streamed == generated
    plain = client.completions.create(**kw).choices[0]
    assert "token_ids" not in plain.model_extra and plain.logprobs.tokens == named.logprobs.tokens  # off by default
    messages = [{"role": "user", "content": "Say hi."}]
    chat = dict(model=MODEL, messages=messages, max_tokens=20, temperature=0, logprobs=True,
                extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
    answer = client.chat.completions.create(**chat)
    prompt_ids = client.post("/../tokenize", body={"model": MODEL, "messages": messages}, cast_to=object)["tokens"]
    assert answer.model_extra["prompt_token_ids"] == prompt_ids
    generated = answer.choices[0].model_extra["token_ids"]
    assert tok.decode(generated, skip_special_tokens=True) == answer.choices[0].message.content
    shown = [t for t in generated if t not in tok.all_special_ids]
    assert [e.token for e in answer.choices[0].logprobs.content] == [f"token_id:{t}" for t in shown]
    assert b"".join(bytes(e.bytes) for e in answer.choices[0].logprobs.content) == answer.choices[0].message.content.encode()
    streamed = list(client.chat.completions.create(**chat, stream=True))
    assert streamed[0].model_extra["prompt_token_ids"] == prompt_ids
    assert [t for c in streamed if c.choices for t in c.choices[0].model_extra["token_ids"]] == generated
    if answer.choices[0].finish_reason == "stop":  # the end-of-turn token rides in a chunk of its own ids
        assert generated[-1] in tok.all_special_ids


def test_special_tokens_kept_in_the_text_on_request(client, local):
    """vLLM's ``skip_special_tokens: false``: the text keeps special tokens (here the end of a turn
    and the next turn's start, generated past the end of the turn with ``ignore_eos``), streamed or
    not, and the chat log-probabilities' entries then join to that text; the end-of-turn token
    that ends an answer is still left out.  The tokens do not change."""
    tok = local.target.tokenizer
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=40, temperature=0, logprobs=True)
    on = {"return_token_ids": True, "ignore_eos": True}
    plain = client.chat.completions.create(**chat, extra_body=on).choices[0]
    kept = client.chat.completions.create(**chat, extra_body={**on, "skip_special_tokens": False}).choices[0]
    ids = kept.model_extra["token_ids"]
    assert ids == plain.model_extra["token_ids"] and any(t in tok.all_special_ids for t in ids[:-1])
    assert plain.message.content == tok.decode(ids, skip_special_tokens=True)
    assert kept.message.content == tok.decode(ids, skip_special_tokens=False) != plain.message.content
    assert b"".join(bytes(e.bytes) for e in kept.logprobs.content) == kept.message.content.encode()
    streamed = client.chat.completions.create(**chat, stream=True, extra_body={**on, "skip_special_tokens": False})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == kept.message.content
    ended = client.chat.completions.create(**{**chat, "max_tokens": 60}, extra_body={"return_token_ids": True, "skip_special_tokens": False}).choices[0]
    ids = ended.model_extra["token_ids"]
    assert ended.finish_reason == "stop" and ids[-1] in local.target.eos_ids
    assert ended.message.content == tok.decode(ids[:-1], skip_special_tokens=False)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client, local):
    """The request lm-evaluation-harness's ``local-completions`` sends for a log-likelihood (token
    ids, ``echo``, ``logprobs`` 1, ``max_tokens`` 1, T = 0): an entry per prompt token, the first
    null, each later one the target's log-softmax after the tokens before it (here against one
    whole pass of the local model), then the generated token's, as without ``echo``; streamed, the
    echoed prompt's chunk carries the prompt's entries and the rest follow as without a stream."""
    ids = local.encode("The quick brown fox jumps over the lazy dog. def add(a, b): return a + b", chat=False)
    kw = dict(model=MODEL, max_tokens=1, temperature=0, logprobs=1)
    out = client.completions.create(prompt=[ids], echo=True, **kw).choices[0]
    lp = out.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    model = local.target.model
    law = torch.log_softmax(model.forward(torch.tensor(ids[:-1]), model.new_cache(len(ids))).double(), -1)
    want = law.gather(1, torch.tensor(ids[1:]).view(-1, 1)).squeeze(1).tolist()
    assert lp.token_logprobs[1:-1] == pytest.approx(want, abs=1e-4)
    best = law.max(-1)
    assert [max(top.values()) for top in lp.top_logprobs[1:-1]] == pytest.approx(best.values.tolist(), abs=1e-4)
    assert sum(a == pytest.approx(b, abs=1e-6) for a, b in zip(lp.token_logprobs[1:-1], best.values.tolist())) > 2
    streamed = [c.choices[0] for c in client.completions.create(prompt=[ids], echo=True, stream=True, **kw) if c.choices]
    assert streamed[0].text == local.target.tokenizer.decode(ids) and len(streamed[0].logprobs.tokens) == len(ids)
    assert [v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs] == lp.token_logprobs
    assert [o for c in streamed if c.logprobs for o in c.logprobs.text_offset] == lp.text_offset
    assert "".join(c.text for c in streamed) == out.text
    alone = client.completions.create(prompt=[ids], **kw).choices[0]
    assert out.text == local.target.tokenizer.decode(ids) + alone.text
    assert lp.tokens[-1:] == alone.logprobs.tokens and lp.token_logprobs[-1] == pytest.approx(alone.logprobs.token_logprobs[0])


def test_max_tokens_zero_with_echo_scores_the_prompt_and_generates_nothing(client, local):
    """OpenAI's legacy scoring request (``echo``, ``logprobs``, ``max_tokens`` 0): the prompt's
    entries alone, the same as with ``max_tokens`` 1 less the generated token's, streamed or not;
    no completion tokens.  ``max_tokens`` 0 without ``echo``, or on chat, is a 400."""
    ids = local.encode("Speculative decoding keeps the target's law exactly.", chat=False)
    kw = dict(model=MODEL, prompt=[ids], echo=True, temperature=0, logprobs=2)
    one = client.completions.create(max_tokens=1, **kw).choices[0].logprobs
    out = client.completions.create(max_tokens=0, **kw)
    choice = out.choices[0]
    assert choice.text == local.target.tokenizer.decode(ids) and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    assert choice.logprobs.tokens == one.tokens[:-1] and len(choice.logprobs.tokens) == len(ids)
    assert choice.logprobs.token_logprobs == one.token_logprobs[:-1]
    assert choice.logprobs.top_logprobs == one.top_logprobs[:-1] and choice.logprobs.text_offset == one.text_offset[:-1]
    assert out.model_extra["specdec"]["target_calls"] == 0
    chunks = list(client.completions.create(max_tokens=0, stream=True, stream_options={"include_usage": True}, **kw))
    streamed = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in streamed) == choice.text and streamed[-1].finish_reason == "length"
    assert [v for c in streamed if c.logprobs for v in c.logprobs.token_logprobs] == choice.logprobs.token_logprobs
    assert chunks[-1].usage.completion_tokens == 0
    plain = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0)
    assert plain.choices[0].text == PROMPT and plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError, match="max_tokens 0 needs echo"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=0)


def test_vllms_prompt_logprobs_on_completions_and_chat(client, local):
    """vLLM's ``prompt_logprobs`` extension: per prompt token after the first a map from token id
    to log-probability, rank and text, the prompt's token first (its rank against one whole pass
    of the local model), then the best ones ranked 1, 2, ...; on a completion per choice (the same
    numbers ``echo`` reports), on chat for the conversation's tokens; streamed, a 400."""
    ids = local.encode("Lossless speculative decoding on two cores.", chat=False)
    kw = dict(model=MODEL, prompt=[ids], max_tokens=2, temperature=0)
    echoed = client.completions.create(echo=True, logprobs=1, **kw).choices[0].logprobs
    out = client.completions.create(extra_body={"prompt_logprobs": 3}, **kw)
    got = out.choices[0].model_extra["prompt_logprobs"]
    model = local.target.model

    def check(got: list, prompt: list[int]) -> None:
        assert len(got) == len(prompt) and got[0] is None
        law = torch.log_softmax(model.forward(torch.tensor(prompt[:-1]), model.new_cache(len(prompt))).double(), -1)
        for at, token, row in zip(got[1:], prompt[1:], law):
            first, *rest = at.items()
            assert int(first[0]) == token and first[1]["logprob"] == pytest.approx(float(row[token]), abs=1e-4)
            assert first[1]["rank"] == 1 + int((row > row[token]).sum())
            assert first[1]["decoded_token"] == local.target.tokenizer.decode([token])
            best = row.topk(3)
            want = [(str(i), r) for r, i in enumerate(best.indices.tolist(), start=1) if i != token]
            assert [(k, v["rank"]) for k, v in rest] == want
            assert [v["logprob"] for _, v in rest] == pytest.approx([float(row[int(k)]) for k, _ in want], abs=1e-4)

    check(got, ids)
    assert [at[str(t)]["logprob"] for at, t in zip(got[1:], ids[1:])] == echoed.token_logprobs[1:len(ids)]
    assert sum(1 for at, t in zip(got[1:], ids[1:]) if at[str(t)]["rank"] > 1) >= 2  # not only the best tokens
    plain = client.completions.create(**kw)
    assert out.choices[0].text == plain.choices[0].text and "prompt_logprobs" not in plain.choices[0].model_extra
    messages = [{"role": "user", "content": "Say hi."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 3})
    check(chat.model_extra["prompt_logprobs"], local.encode_messages(messages))
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs cannot be streamed"):
        client.completions.create(stream=True, extra_body={"prompt_logprobs": 1}, **kw)
    with pytest.raises(openai.BadRequestError, match="stream_options is only allowed with stream"):  # as OpenAI answers
        client.completions.create(stream_options={"include_usage": True}, **kw)
    with pytest.raises(openai.BadRequestError, match="stream_options is only allowed with stream"):
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream_options={"include_usage": True})


def test_best_of_returns_the_n_candidates_with_the_best_mean_logprob(client):
    """OpenAI's ``best_of``: best_of candidates per prompt, the n with the highest log-probability
    per token returned, best first; usage counts every candidate.  With a seed, candidate j is
    the request's choice j of ``n = best_of`` (seed + j), so the ranking is checked against those."""
    prompts = [PROMPT, "Once upon a time"]
    kw = dict(model=MODEL, prompt=prompts, max_tokens=10, temperature=1.0, seed=11, stop=["e"])  # lengths differ
    every = client.completions.create(**kw, n=4, logprobs=0)
    by_prompt = {p: [] for p in range(2)}
    for c in every.choices:
        lps = c.logprobs.token_logprobs
        by_prompt[c.index // 4].append((-sum(lps) / len(lps), c.index, c.text, lps))
    best = client.completions.create(**kw, n=2, best_of=4)
    want = [text for p in range(2) for _, _, text, _ in sorted(by_prompt[p])[:2]]
    assert [c.text for c in best.choices] == want and [c.index for c in best.choices] == [0, 1, 2, 3]
    by_sum = [c[2] for p in range(2) for c in sorted(by_prompt[p], key=lambda c: (c[0] * len(c[3]), c[1]))[:2]]
    assert by_sum != want  # per token, not summed: the sum (which favours short answers) would pick others
    assert all(c.logprobs is None for c in best.choices)  # ranked by logprobs, not asked for them
    assert best.usage.completion_tokens == every.usage.completion_tokens  # every candidate counted
    scored = client.completions.create(**kw, n=1, best_of=4, logprobs=1).choices
    assert [c.text for c in scored] == [sorted(by_prompt[p])[0][2] for p in range(2)]
    assert [c.logprobs.token_logprobs for c in scored] == [sorted(by_prompt[p])[0][3] for p in range(2)]
    same = client.completions.create(**kw, n=2, best_of=2)  # best_of = n: every choice, in order
    assert [c.text for c in same.choices] == [c.text for c in client.completions.create(**kw, n=2).choices]


def test_n_list_prompts_echo_logit_bias_ignore_eos(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=11)
    many = client.completions.create(**kw, n=2)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == client.completions.create(**kw).choices[0].text
    assert many.choices[1].text == client.completions.create(**{**kw, "seed": 12}).choices[0].text
    assert many.usage.completion_tokens == 20 or many.choices[0].finish_reason == "stop"
    greedy = dict(model=MODEL, max_tokens=6, temperature=0)
    both = client.completions.create(prompt=[PROMPT, "import os"], **greedy)
    assert [c.text for c in both.choices] == [client.completions.create(prompt=p, **greedy).choices[0].text
                                              for p in (PROMPT, "import os")]
    echoed = client.completions.create(prompt=PROMPT, echo=True, **greedy)
    assert echoed.choices[0].text == PROMPT + both.choices[0].text
    forced = client.completions.create(prompt=PROMPT, logit_bias={"42": 100}, logprobs=0, **greedy)
    assert len(forced.choices[0].logprobs.tokens) == 6 and len(set(forced.choices[0].logprobs.tokens)) == 1
    eos = "2"  # SmolLM2's <|im_end|>
    stopped = client.completions.create(prompt=PROMPT, logit_bias={eos: 100}, **greedy)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    kept = client.completions.create(prompt=PROMPT, logit_bias={eos: 100}, extra_body={"ignore_eos": True}, **greedy)
    assert kept.choices[0].finish_reason == "length" and kept.usage.completion_tokens == 6


def test_vllm_min_tokens_stop_token_ids_and_include_stop(client, local):
    """vLLM's min_tokens (end-of-sequence masked until then), stop_token_ids (the token ends the
    output and stays in the ids, its text does not, unless include_stop_str_in_output), and the
    extensions that would change the output but are not implemented: a 400, never ignored."""
    greedy = dict(model=MODEL, prompt=PROMPT, temperature=0)
    eos = "2"  # SmolLM2's <|im_end|>, forced by the bias
    floored = client.completions.create(max_tokens=8, logit_bias={eos: 100}, extra_body={"min_tokens": 4}, **greedy)
    assert floored.choices[0].finish_reason == "stop" and floored.usage.completion_tokens == 5
    ref = local.generate(PROMPT, SamplingConfig(temperature=0.0, max_new_tokens=12), gamma=4).token_ids
    at = next(i for i in range(2, len(ref)) if ref[i] not in ref[:i])  # a token's first appearance
    tok = local.target.tokenizer
    cut = client.completions.create(max_tokens=12, logprobs=0, extra_body={"stop_token_ids": [ref[at]]}, **greedy)
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == at + 1
    assert cut.choices[0].text == tok.decode(ref[:at]) and len(cut.choices[0].logprobs.tokens) == at + 1
    kept = client.completions.create(max_tokens=12, extra_body={"stop_token_ids": [ref[at]], "include_stop_str_in_output": True},
                                     **greedy)
    assert kept.choices[0].text == tok.decode(ref[: at + 1])
    streamed = client.completions.create(max_tokens=12, stream=True, extra_body={"stop_token_ids": [ref[at]]}, **greedy)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text
    text = tok.decode(ref)
    stop = text[len(tok.decode(ref[:at])) :][:2]
    with_stop = client.completions.create(max_tokens=12, stop=[stop], extra_body={"include_stop_str_in_output": True}, **greedy)
    assert with_stop.choices[0].text == text[: text.index(stop) + len(stop)]
    for body, message in (({"min_tokens": 13}, "must not exceed max_tokens"), ({"logits_processors": ["x"]}, "logits_processors"),
                          ({"use_beam_search": True}, "use_beam_search"), ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
                          ({"stop_token_ids": [10**8]}, "outside the vocabulary")):
        with pytest.raises(openai.BadRequestError, match=message):
            client.completions.create(max_tokens=12, extra_body=body, **greedy)


def test_vllm_allowed_token_ids_and_bad_words(client, local):
    """vLLM's allowed_token_ids (nothing else sampled) and bad_words (no word completed, as written or
    after a space): greedy answers equal local decoding under the same filter, which changes them."""
    from specdec.token_filter import TokenFilter, bad_word_ids

    greedy = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=16)
    vocab = local.target.model.vocab_size
    free = local.generate(PROMPT, SamplingConfig(temperature=0.0, max_new_tokens=16), gamma=4)
    allowed = sorted(set(free.token_ids[1:]))  # the first token is not among them (checked below)
    ref = local.generate(PROMPT, SamplingConfig(temperature=0.0, max_new_tokens=16,
                                                constraint=TokenFilter(vocab, allowed_ids=allowed)), gamma=4)
    assert free.token_ids[0] not in allowed and set(ref.token_ids) <= set(allowed)
    out = client.completions.create(logprobs=0, extra_body={"allowed_token_ids": allowed}, **greedy)
    assert out.choices[0].text == ref.text and out.model_extra["specdec"]["lossless"] is True
    word = next(w for w in free.text.split() if w.isalpha() and len(w) > 2)  # a word the free answer has
    tok = local.target.tokenizer
    banned = TokenFilter(vocab, banned=bad_word_ids(tok, [word]))
    ref = local.generate(PROMPT, SamplingConfig(temperature=0.0, max_new_tokens=16, constraint=banned), gamma=4)
    assert ref.text != free.text
    for endpoint in ("completions", "stream"):
        if endpoint == "stream":
            chunks = client.completions.create(stream=True, extra_body={"bad_words": [word]}, **greedy)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
        else:
            text = client.completions.create(extra_body={"bad_words": [word]}, **greedy).choices[0].text
        assert text == ref.text
    for seq in bad_word_ids(tok, [word]):
        assert not any(tuple(ref.token_ids[i:i + len(seq)]) == seq for i in range(len(ref.token_ids)))
    for body, message in (({"allowed_token_ids": []}, "must not be empty"),
                          ({"allowed_token_ids": [1, 10**8]}, "outside the vocabulary"),
                          ({"bad_words": [" "]}, "white space")):
        with pytest.raises(openai.BadRequestError, match=message):
            client.completions.create(extra_body=body, **greedy)


def test_tokenizer_endpoints_answer_as_vllms_do(http, server, client, local):
    """/tokenize, /detokenize and /tokenizer_info (what lm-evaluation-harness's remote tokenizer
    calls): a prompt's ids are those /v1/completions generates after, messages' those
    /v1/chat/completions does, and ids come back to the text; bad requests are 4xx."""
    tok = local.target.tokenizer
    got = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT, "return_token_strs": True}).json()
    ids = tok.encode(PROMPT, add_special_tokens=False)
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] == local.target.model.max_length
    assert got["token_strs"] == tok.convert_ids_to_tokens(ids)
    greedy = dict(model=MODEL, max_tokens=6, temperature=0)
    assert client.completions.create(prompt=got["tokens"], **greedy).choices[0].text == \
        client.completions.create(prompt=PROMPT, **greedy).choices[0].text
    messages = [{"role": "user", "content": "Say hi."}]
    chat = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert chat == local.encode_messages(messages)
    assert client.completions.create(prompt=chat, **greedy).choices[0].text == \
        client.chat.completions.create(messages=messages, **greedy).choices[0].message.content
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPT}
    info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    assert http.post("/tokenize", json={"prompt": PROMPT, "messages": messages}).status_code == 400
    assert http.post("/tokenize", json={}).status_code == 400
    assert http.post("/tokenize", json={"model": "gpt-4", "prompt": "x"}).status_code == 404
    bad = http.post("/detokenize", json={"tokens": [1, 10**9]})
    assert bad.status_code == 400 and "outside the vocabulary" in bad.json()["error"]["message"]
    for path, body in (("/detokenize", {"tokens": [-1]}), ("/tokenize", {"prompt": 5})):  # schema errors: 400, not 422
        bad = http.post(path, json=body)
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error", (path, bad.text)
    assert http.post("/tokenize", content=b"{", headers={"Content-Type": "application/json"}).status_code == 400
    assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}, timeout=30).status_code == 401  # keys hold here too


def test_chat_continues_the_final_message_and_takes_template_options(http, client, local):
    """vLLM's continue_final_message (the reply continues the caller's start of it: the rendered
    text ends right after that message's content), add_generation_prompt and chat_template_kwargs
    (the template's own variables); /tokenize gives the ids the chat generates after; the options
    that would contradict each other, echo and chat_template are 400s."""
    tok = local.target.tokenizer
    messages = [{"role": "user", "content": "Count from one to ten."}, {"role": "assistant", "content": "One, two,"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    opened = rendered[: rendered.rindex("One, two,") + len("One, two,")]
    assert opened != rendered and opened.endswith("One, two,")
    ids = tok.encode(opened, add_special_tokens=False)
    ref = local.generate(ids, SamplingConfig(temperature=0.0, max_new_tokens=8), gamma=4)
    body = {"continue_final_message": True, "add_generation_prompt": False}
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=body)
    assert out.choices[0].message.content == ref.text and out.usage.prompt_tokens == len(ids)
    closed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                            extra_body={"add_generation_prompt": False})
    assert closed.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    assert http.post("/tokenize", json={"messages": messages, **body}).json()["tokens"] == ids
    kw = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=8, temperature=0,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    plain = client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=8, temperature=0)
    assert kw.choices[0].message.content == plain.choices[0].message.content  # a variable this template ignores
    for extra, message in (({"continue_final_message": True}, "needs add_generation_prompt false"),
                           ({"chat_template_kwargs": {"messages": []}}, "may not set messages"),
                           ({"echo": True}, "echo"), ({"chat_template": "{{ 1 }}"}, "--trust-request-chat-template")):
        with pytest.raises(openai.BadRequestError, match=message):
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, extra_body=extra)


def test_streams_carry_n_choices_and_the_stats_on_the_last_chunk(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                                 temperature=1.0, seed=3, n=2, stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    stats = chunks[-1].model_extra["specdec"]
    assert stats["method"] == "coupled" and stats["target_calls"] >= 1 and stats["lossless"] is True


def test_near_valid_completion_requests_never_get_a_5xx(http):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    floats = lambda lo, hi: st.floats(lo, hi, allow_nan=False)  # noqa: E731
    body = st.fixed_dictionaries(
        {"model": st.just(MODEL), "prompt": st.text(max_size=12) | st.lists(st.integers(0, 49_160), max_size=4)},
        optional={
            "max_tokens": st.integers(-1, 5), "temperature": floats(-0.5, 2.5), "top_p": floats(-0.1, 1.1),
            "top_k": st.integers(0, 60), "min_p": floats(-0.1, 1.1), "repetition_penalty": floats(-0.5, 2.0),
            "frequency_penalty": floats(-3, 3), "seed": st.integers(-1, 5), "stream": st.booleans(),
            "stop": st.sampled_from(["\n", ["a", "b"], "", None]),
            "method": st.sampled_from(["greedy", "token", "block", "coupled", "lossy-resample-p", "nope"]),
            "gamma": st.sampled_from([1, 3, "auto", "guide", 0, 65, "x"]),
        },
    )

    @settings(max_examples=25, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(body=body)
    def run(body):
        r = http.post("/v1/completions", json=body)
        assert r.status_code < 500, r.text
        if r.status_code != 200:
            assert r.json()["error"]["message"]
        elif body.get("stream"):
            events = [line for line in r.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "data: [DONE]"
        else:
            assert r.json()["usage"]["completion_tokens"] <= body.get("max_tokens", 16)

    run()


def test_the_event_loop_stays_responsive_during_a_generation(server, client):
    """Model work runs in worker threads: /health answers quickly while a completion is running."""
    import threading
    import time

    done = threading.Event()
    produced: list[int] = []

    def generate() -> None:
        out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=200, temperature=1.0, seed=3,
                                        extra_body={"gamma": 1, "ignore_eos": True})  # long, whatever the weights
        produced.append(out.usage.completion_tokens)
        done.set()

    worker = threading.Thread(target=generate)
    worker.start()
    quick = 0
    try:
        while not done.is_set():
            started = time.perf_counter()
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            if not done.is_set() and time.perf_counter() - started < 1.0:
                quick += 1
            time.sleep(0.05)
    finally:
        worker.join()
    assert produced[0] >= 100 and quick >= 2, (produced, quick)


def test_openai_requests_update_the_speculative_counters_and_latency_histograms(client, server):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
    text = httpx.get(server.url + "/metrics", timeout=30).text  # no key needed to scrape
    for name in (
        'specdec_verify_calls_total{lossless="true",wire="openai"}',
        'specdec_draft_tokens_proposed_total{wire="openai"}',
        'specdec_draft_tokens_accepted_total{wire="openai"}',
        'specdec_draft_position_proposed_total{position="1",wire="openai"}',
        'specdec_draft_position_accepted_total{position="1",wire="openai"}',
        'specdec_time_to_first_token_seconds_count{endpoint="chat"}',
        'specdec_inter_token_seconds_count{endpoint="chat"}',
        'specdec_request_seconds_count{endpoint="chat"}',
        'specdec_prompt_tokens_total{endpoint="chat"}',
    ):
        assert name in text, name


SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 0, "maximum": 99},
                   "ok": {"type": "boolean"}},
    "required": ["color", "count", "ok"],
    "additionalProperties": False,
}


def _matches(value) -> bool:
    return (isinstance(value, dict) and set(value) == {"color", "count", "ok"} and value["color"] in ("red", "green", "blue")
            and type(value["count"]) is int and 0 <= value["count"] <= 99 and type(value["ok"]) is bool)


def test_structured_output_parses_and_matches_the_schema_under_speculation(client):
    messages = [{"role": "user", "content": "Describe a ball as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "ball", "schema": SCHEMA}}
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=1.0, seed=4, n=4,
                                         response_format=fmt)
    assert len(out.choices) == 4
    for choice in out.choices:
        assert choice.finish_reason == "stop" and _matches(json.loads(choice.message.content)), choice.message.content
    stats = out.model_extra["specdec"]
    assert stats["draft_tokens_proposed"] > 0 and stats["lossless"] is True  # speculation ran, constrained on both sides
    anyobj = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                            response_format={"type": "json_object"}).choices[0]
    if anyobj.finish_reason == "stop":  # a free-form object may also run out of tokens (this model: 100.000...)
        assert isinstance(json.loads(anyobj.message.content), dict)
    assert anyobj.message.content.startswith("{")
    digits = client.completions.create(model=MODEL, prompt="The year was", max_tokens=8, temperature=1.0, seed=2,
                                       extra_body={"response_format": {"type": "regex", "regex": " [0-9]{4}"}})
    text = digits.choices[0].text
    assert len(text) == 5 and text[0] == " " and text[1:].isdigit()
    # under bad_words (the choices' own filter over each choice's grammar): both hold, whatever the seed
    for seed in (2, 3):
        fours = client.completions.create(model=MODEL, prompt="The year was", max_tokens=8, temperature=1.0, seed=seed, n=2,
                                          extra_body={"response_format": {"type": "regex", "regex": " [0-9]{4}"},
                                                      "bad_words": list("13579")})
        for choice in fours.choices:
            assert len(choice.text) == 5 and choice.text[0] == " " and set(choice.text[1:]) <= set("02468"), choice.text
    with pytest.raises(openai.BadRequestError, match="invalid"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"response_format": {"type": "grammar", "grammar": "start: ("}})
    for spec in ("abc", [1], None):  # a json_schema that is not an object: a 400, not an AttributeError's 500
        with pytest.raises(openai.BadRequestError, match="json_schema"):
            client.completions.create(model=MODEL, prompt="x", extra_body={"response_format": {"type": "json_schema", "json_schema": spec}})


def test_vllm_guided_decoding_fields(client):
    """vLLM's guided_choice / _regex / _json / _grammar and structured_outputs make the same grammar
    response_format does: the output obeys it under speculation, greedy and sampled."""
    choices = ["positive", "negative", "not sure"]
    prompt = "Review: the food was cold and late.\nSentiment:"
    bodies = [{"guided_choice": choices}, {"structured_outputs": {"choice": choices}},
              {"guided_grammar": 'start: "positive" | "negative" | "not sure"'},
              {"structured_outputs": {"grammar": 'start: "positive" | "negative" | "not sure"', "disable_fallback": True}}]
    for body in bodies:
        greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body=body)
        assert greedy.choices[0].text in choices and greedy.choices[0].finish_reason == "stop", body
        sampled = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=5, n=3,
                                            extra_body=body)
        assert all(c.text in choices for c in sampled.choices) and sampled.model_extra["specdec"]["lossless"], body
    for body in ({"guided_regex": " [0-9]{4}"}, {"structured_outputs": {"regex": " [0-9]{4}"}}):
        text = client.completions.create(model=MODEL, prompt="The year was", max_tokens=8, temperature=1.0, seed=2,
                                         extra_body=body).choices[0].text
        assert len(text) == 5 and text[0] == " " and text[1:].isdigit(), body
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    for body in ({"guided_json": schema}, {"guided_json": json.dumps(schema)}, {"structured_outputs": {"json": schema}}):
        out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is the sky blue? JSON."}],
                                             max_tokens=20, temperature=0, extra_body=body).choices[0]
        assert json.loads(out.message.content) in ({"ok": True}, {"ok": False}), body
    for body, message in (({"guided_choice": choices, "guided_regex": "a"}, "guided_regex and guided_choice"),
                          ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format and guided_regex"),
                          ({"guided_choice": []}, "non-empty strings"), ({"guided_choice": ["a", ""]}, "non-empty strings"),
                          ({"guided_json": "{bad"}, "invalid guided_json"), ({"guided_json": "[1]"}, "a JSON Schema"),
                          ({"guided_regex": "("}, "invalid"), ({"guided_regex": "(a{1000}){1000}"}, "the grammar cannot be followed"), ({"guided_grammar": 'root ::= "yes"'}, "invalid grammar"), ({"structured_outputs": {"structural_tag": "x"}}, "structural_tag")):
        with pytest.raises(openai.BadRequestError, match=message):
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body=body)


def test_openais_bounds_on_n_best_of_and_logprobs_are_400s(client, local):
    """n and best_of at most 16 (vLLM's and this server's bound), logprobs and top_logprobs at most 20
    (OpenAI's), top_logprobs only with logprobs, stop_token_ids inside the vocabulary: one past
    each bound is a 400, never an answer."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
    for bad in ({"n": 17}, {"best_of": 17}, {"logprobs": 21}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**kw, **bad)
    assert len(client.completions.create(**kw, n=16).choices) == 16  # the bound itself is fine
    assert len(client.completions.create(**kw, logprobs=20).choices[0].logprobs.top_logprobs[0]) >= 20
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1, temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**chat, logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(**chat, top_logprobs=2)
    vocab = local.target.model.vocab_size
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(**kw, extra_body={"stop_token_ids": [vocab]})
    assert client.completions.create(**kw, extra_body={"stop_token_ids": [vocab - 1]}).choices


def test_usage_counts_every_prompt_and_streamed_chat_counts_the_conversation(client, local):
    """A list of prompts: usage.prompt_tokens is all of their tokens; a streamed chat's usage chunk
    has the same counts as the answer without a stream."""
    prompts = [PROMPT, "The capital of France is a city"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4, temperature=0)
    want = sum(len(local.encode(p, chat=False)) for p in prompts)
    assert out.usage.prompt_tokens == want and len(local.encode(prompts[0], chat=False)) != want
    assert out.usage.total_tokens == want + out.usage.completion_tokens
    messages = [{"role": "user", "content": "Write a Python hello world."}]
    kw = dict(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    said = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == said.usage.prompt_tokens == len(
        local.encode_messages(messages))
    assert chunks[-1].usage.completion_tokens == said.usage.completion_tokens
    assert chunks[-1].usage.total_tokens == said.usage.total_tokens


def test_every_stop_string_of_a_list_stops_the_answer(client):
    """``stop`` as a list: whichever of its strings comes first ends the answer (left out of the
    text), not only the first string of the list."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
    free = client.completions.create(**kw).choices[0].text
    assert "\n" in free  # the greedy answer runs on to a second line
    out = client.completions.create(**kw, stop=["never-written-xyz", "\n"]).choices[0]
    assert out.finish_reason == "stop" and out.text == free[:free.index("\n")]


def test_echoed_text_offsets_are_where_each_token_starts(client, local):
    """``echo`` with ``logprobs``: text_offset of every token (the prompt's, then the answer's) is
    the character where its text starts in the choice's text (ASCII here: the running sum of the
    tokens' lengths), streamed or not."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, echo=True)
    lp = client.completions.create(**kw).choices[0].logprobs
    starts, at = [], 0
    for token in lp.tokens:
        starts.append(at)
        at += len(token)
    assert lp.text_offset == starts and len(local.encode(PROMPT, chat=False)) > 1
    streamed = [c.choices[0] for c in client.completions.create(**kw, stream=True) if c.choices]
    assert [o for c in streamed if c.logprobs for o in c.logprobs.text_offset] == starts


def test_truncate_to_the_context_leaves_room_for_a_long_answer(client, local):
    """``truncate_prompt_tokens: -1`` keeps as many of the prompt's last tokens as leave room for
    max_tokens in the context: prompt + max_tokens fills it exactly, no 400."""
    context = local.target.model.max_length
    ids = local.encode("The quick brown fox jumps over the lazy dog. " * 3, chat=False)
    eos = "2"  # SmolLM2's <|im_end|>, forced: the long answer ends at once
    out = client.completions.create(model=MODEL, prompt=[ids], max_tokens=context - 10, temperature=0,
                                    logit_bias={eos: 100}, extra_body={"truncate_prompt_tokens": -1, "return_token_ids": True})
    assert out.usage.prompt_tokens == 10 and out.choices[0].model_extra["prompt_token_ids"] == ids[-10:]


def test_include_stop_str_keeps_the_end_of_turn_in_the_logprobs_too(client, local):
    """vLLM's ``include_stop_str_in_output`` with ``skip_special_tokens: false``: the end-of-turn
    token that ends a chat answer stays in its text, and so in its log-probabilities' entries, which
    join to the content."""
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Say hi."}], max_tokens=60, temperature=0, logprobs=True)
    out = client.chat.completions.create(**chat, extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True,
                                                             "return_token_ids": True}).choices[0]
    assert out.finish_reason == "stop" and out.model_extra["token_ids"][-1] in local.target.eos_ids
    assert out.message.content.endswith("<|im_end|>")
    assert "".join(e.token for e in out.logprobs.content) == out.message.content


def test_echoed_offsets_where_the_first_token_holds_part_of_a_character(client):
    prompt = "\U0001F600 hi"  # three tokens spell the emoji, then " hi"
    choice = client.completions.create(model=DRAFT_MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=1,
                                       echo=True).choices[0]
    lp = choice.logprobs
    at = lp.tokens.index(" hi")
    assert lp.text_offset[at] == choice.text.index(" hi") == 1


def _events(r: httpx.Response) -> list[str]:
    return [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]


def test_streams_end_with_done(http):
    """Every stream (completions and chat) ends with the ``data: [DONE]`` event, after the usage chunk."""
    for path, body in (("/v1/completions", {"prompt": PROMPT}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = http.post(path, json={"model": MODEL, "max_tokens": 3, "temperature": 0, "stream": True,
                                  "stream_options": {"include_usage": True}, **body})
        assert r.status_code == 200, r.text
        events = _events(r)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert json.loads(events[-2])["choices"] == [] and json.loads(events[-2])["usage"]["completion_tokens"] >= 1


def test_max_completion_tokens_wins_over_max_tokens(client):
    """With both sent, ``max_completion_tokens`` (OpenAI's current name) bounds the answer, not ``max_tokens``."""
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Write a long story."}],
                                         temperature=0, max_tokens=30, max_completion_tokens=2, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2 and out.choices[0].finish_reason == "length"


def test_stream_chunks_name_their_object_and_open_with_the_role(http):
    """Streamed chat chunks are ``chat.completion.chunk`` (the first the role), streamed completions' ``text_completion``."""
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 3, "temperature": 0, "stream": True})
    chunks = [json.loads(e) for e in _events(r)[:-1]]
    assert chunks and {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True})
    chunks = [json.loads(e) for e in _events(r)[:-1]]
    assert chunks and {c["object"] for c in chunks} == {"text_completion"}


def test_chat_logprobs_carry_content_and_a_null_refusal(http):
    """Chat ``logprobs`` is OpenAI's object of ``content`` entries and ``refusal`` (null), streamed or not."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    lp = http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]
    assert set(lp) == {"content", "refusal"} and lp["refusal"] is None and len(lp["content"]) >= 1
    r = http.post("/v1/chat/completions", json={**body, "stream": True})
    streamed = [c["choices"][0]["logprobs"] for c in map(json.loads, _events(r)[:-1]) if c["choices"][0]["logprobs"]]
    assert streamed and all(set(s) == {"content", "refusal"} and s["refusal"] is None for s in streamed)


def test_an_unknown_response_format_type_is_a_400(http):
    """A ``response_format`` type the server cannot honour is refused with a 400 naming it, never ignored."""
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 2, "response_format": {"type": "xml"}})
    assert r.status_code == 400 and "'xml' is not supported" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_completions_accept_tool_choice_auto_and_none_but_refuse_a_required_call(http):
    """/v1/completions (no tools) accepts ``tool_choice`` none or auto as no-ops; asking for a call is a 400."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    for choice in ("auto", "none"):
        assert http.post("/v1/completions", json={**body, "tool_choice": choice}).status_code == 200
    r = http.post("/v1/completions", json={**body, "tool_choice": "required"})
    assert r.status_code == 400 and "tool_choice is not supported" in r.json()["error"]["message"]


def test_refused_fields_are_400s_not_ignored(http):
    """``audio`` (output this server cannot make) is refused with a 400 that names it."""
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 2, "audio": {"voice": "alloy", "format": "wav"}})
    assert r.status_code == 400 and "audio is not supported" in r.json()["error"]["message"]


def test_each_prompts_n_seeded_choices_use_seed_plus_their_rank(client):
    """With several prompts, ``n`` and a seed, choice j of each prompt samples with seed + j (not seed + its index)."""
    prompts = [PROMPT, "Once upon a time"]
    kw = dict(model=MODEL, max_tokens=8, temperature=1.0)
    many = client.completions.create(prompt=prompts, n=2, seed=11, **kw).choices
    assert [c.index for c in many] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        for j in range(2):
            alone = client.completions.create(prompt=prompt, seed=11 + j, **kw).choices[0]
            assert many[2 * p + j].text == alone.text


def test_streamed_logprobs_keep_tokens_that_bring_no_text(client):
    """A streamed completion token that adds no text (the end-of-sequence token) still sends its logprobs."""
    eos = registry.load_tokenizer(registry.resolve(MODEL).folder).eos_token_id
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, logit_bias={str(eos): 100})
    whole = client.completions.create(**kw).choices[0]
    assert whole.finish_reason == "stop" and whole.text == "" and len(whole.logprobs.tokens) == 1
    chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs is not None]
    assert [t for p in parts for t in p.tokens] == whole.logprobs.tokens
    assert [v for p in parts for v in p.token_logprobs] == whole.logprobs.token_logprobs


def test_an_empty_model_name_is_not_served_here(http):
    """``model: ""`` names no served model: a 404 (only a missing model field means the served one)."""
    r = http.post("/v1/completions", json={"model": "", "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 404 and "not served here" in r.json()["error"]["message"]
    assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_a_streamed_end_of_turn_sends_no_empty_logprobs_chunk(http):
    """A streamed chat's end-of-turn token brings no chunk of empty content and empty logprobs."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 40, "temperature": 0,
            "logprobs": True}
    assert http.post("/v1/chat/completions", json=body).json()["choices"][0]["finish_reason"] == "stop"
    chunks = [json.loads(e)["choices"][0] for e in _events(http.post("/v1/chat/completions", json={**body, "stream": True}))[:-1]]
    assert chunks[-1]["finish_reason"] == "stop"
    assert all(c["logprobs"]["content"] for c in chunks if c["logprobs"] is not None)
    assert all(c["delta"].get("content") or c["delta"].get("role") for c in chunks[:-1])


def test_a_developer_message_is_rendered_as_a_system_message(http):
    """OpenAI's ``developer`` role reaches the chat template as ``system``: the same prompt tokens."""
    def tokens(role: str) -> list[int]:
        r = http.post("/tokenize", json={"model": MODEL, "messages": [{"role": role, "content": "Be terse."},
                                                                     {"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    assert tokens("developer") == tokens("system")


def test_streamed_chat_logprobs_keep_a_stop_tokens_entry(http):
    """Streamed chat sends the logprobs entry of a stop token that adds no content, as the unstreamed answer has it."""
    hello = 19556  # an ordinary token of the served tokenizer, forced and made the stop token
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0,
            "logprobs": True, "logit_bias": {str(hello): 100}, "stop_token_ids": [hello]}
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert whole["finish_reason"] == "stop"
    chunks = [json.loads(e)["choices"][0] for e in _events(http.post("/v1/chat/completions", json={**body, "stream": True}))[:-1]]
    streamed = [e for c in chunks if c["logprobs"] is not None for e in c["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e["token"] for e in whole["logprobs"]["content"]]


def test_a_stream_names_its_ignored_fields_and_stream_options(http):
    """A streamed response names the ignored fields in its header, unknown ``stream_options`` keys as ``stream_options.<key>``."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True, "frob": 1}, "user": "me"}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    ignored = {f.strip() for f in r.headers["x-specdec-ignored-fields"].split(",")}
    assert {"stream_options.frob", "user"} <= ignored


def test_parallel_tool_calls_is_named_ignored_when_tool_choice_none_hides_the_tools(http):
    """``parallel_tool_calls`` with ``tool_choice: none`` (no tools shown) is named as ignored; with tools shown it is not."""
    add = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0,
            "tools": [add], "parallel_tool_calls": False}

    def ignored(choice: str) -> set[str]:
        r = http.post("/v1/chat/completions", json={**body, "tool_choice": choice})
        assert r.status_code == 200, r.text
        return {f.strip() for f in r.headers.get("x-specdec-ignored-fields", "").split(",")}

    assert "parallel_tool_calls" in ignored("none") and "parallel_tool_calls" not in ignored("auto")
