"""The OpenAI-compatible endpoints, driven by the official ``openai`` client against ``specdec serve``.

The server process serves the bundled 15.7 M-parameter SmolLM2 draft as its target (fast on a CPU)
with itself as drafter; greedy answers must equal local speculative decoding with the same γ.
"""

from __future__ import annotations

import openai
import pytest

from serverproc import ServerProcess
from specdec.engine import Engine, EngineConfig
from specdec.sampling import SamplingConfig

MODEL = "smollm2-135m-draft"
KEY = "openai-test-key"
PROMPT = "def add(a, b):"


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def server():
    with ServerProcess.cli("--target", MODEL, "--draft", MODEL, "--dtype", "float32", "--api-key", KEY, "--gamma", "4") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def local():
    return Engine.build(EngineConfig(target=MODEL, draft=MODEL, dtype="float32"))


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


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


def test_sampling_options_stop_and_seed(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.9, top_p=0.95, seed=7)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw, extra_body={"top_k": 50, "repetition_penalty": 1.1, "method": "coupled"})
    assert a == client.completions.create(**kw).choices[0].text  # a fixed seed repeats itself
    assert b.model_extra["specdec"]["method"] == "coupled"
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=["\n"])
    assert "\n" not in out.choices[0].text and out.choices[0].finish_reason == "stop"


def test_errors_come_back_as_openai_errors(client, server):
    with pytest.raises(openai.BadRequestError, match="n > 1"):
        client.completions.create(model=MODEL, prompt=PROMPT, n=2)
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=MODEL, prompt=PROMPT, logprobs=2)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100_000)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4", prompt=PROMPT)
    with pytest.raises(openai.UnprocessableEntityError, match="tools"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       tools=[{"type": "function", "function": {"name": "f"}}])
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError, match="API key"):
            bad.models.list()


def test_near_valid_completion_requests_never_get_a_5xx(server):
    import httpx
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

    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:

        @settings(max_examples=25, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(body=body)
        def run(body):
            r = c.post("/v1/completions", json=body)
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

    import httpx

    done = threading.Event()
    produced: list[int] = []

    def generate() -> None:
        out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=200, temperature=1.0, seed=3,
                                        extra_body={"gamma": 1})
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
