"""The OpenAI endpoints under random combinations of options, against a server that does not draft.

Four server processes hold the same target (the bundled SmolLM2 draft model in float32, fast on a
CPU): one with ``--draft none`` (the oracle: plain decoding) and three that speculate with
drafters that are often wrong (prompt lookup, Lookahead, the target's first two layers).  A
seeded random generator writes ``N_REQUESTS`` requests, each drawing from every option the
endpoints take — chat or completions, streaming, n, echo, stop strings and ids, min_tokens,
ignore_eos, logit_bias, the three penalties, top-k / top-p / min-p, allowed_token_ids, bad_words,
structured output (regex, choice, JSON schema), logprobs (tokens named by text or by id), the
generated token ids, γ, token trees and the rule — and sends them to
every server from ``CONCURRENCY`` threads at once, so the batching scheduler mixes them.

Where the output is a function of the request (greedy, or a seed under the coupled rule, the
default with a seed) every speculating server must answer what the plain one answers: the same
text, token log-probabilities, finish reasons and token counts, streamed or not.  Elsewhere
(block or token verification at T > 0, or no seed) each answer must still be a well-formed 200
within ``max_tokens``.  Every request must succeed.  The drafters must have drafted and been
wrong often (each server's acceptance over the compared requests between 0.1 and 0.9: ~0.35 for
lookup and Lookahead, ~0.2 for the two-layer view when this was written).  A penalty that counted
only the previous draft token instead of all earlier ones (a one-line break of
``sampling._apply_penalties``) failed it on a greedy chat request.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serverproc import ServerProcess

MODEL = "smollm2-135m-draft"
KEY = "differential-key"
N_REQUESTS = 64
CONCURRENCY = 6
DRAFTERS = ("ngram", "lookahead", "layerskip:2")

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.xdist_group("differential")]

PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Write a short poem about the sea.",
    "1, 2, 3, 4, 5, 6,",
    "Q: What is the capital of France?\nA:",
]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def servers():
    common = ("--target", MODEL, "--dtype", "float32", "--api-key", KEY)
    procs = [ServerProcess.cli(*common, "--draft", "none")]
    procs += [ServerProcess.cli(*common, "--draft", d, "--gamma", "3", "--no-draft-cap") for d in DRAFTERS]
    for p in procs:
        p.start(wait=False)
    try:
        for p in procs:
            p.wait_ready()
        yield [p.url for p in procs]
    finally:
        for p in procs:
            p.stop()


def _vocabulary_sample(url: str) -> list[int]:
    """Token ids of a short English and Python text (what allowed_token_ids may name)."""
    text = " ".join(PROMPTS) + " the a an is of and to in it"
    r = httpx.post(url + "/tokenize", json={"prompt": text}, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    r.raise_for_status()
    return sorted(set(r.json()["tokens"]))


def _request(rng: random.Random, ids: list[int]) -> tuple[str, dict]:
    chat = rng.random() < 0.4
    temperature = rng.choice([0.0, 0.0, 0.7, 1.0])
    body: dict = {"model": MODEL, "max_tokens": rng.randint(1, 28), "temperature": temperature}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    else:
        body["prompt"] = rng.choice(PROMPTS)
        body["echo"] = rng.random() < 0.15
    if temperature > 0:
        if rng.random() < 0.8:
            body["seed"] = rng.randint(0, 10**6)
        for key, values in (("top_p", [0.5, 0.9]), ("top_k", [1, 5, 40]), ("min_p", [0.05, 0.2])):
            if rng.random() < 0.3:
                body[key] = rng.choice(values)
        if rng.random() < 0.3:
            body["method"] = rng.choice(["block", "token", "coupled"])
    if rng.random() < 0.3:
        body["n"] = rng.randint(2, 3)
    if rng.random() < 0.3:
        body["stop"] = rng.sample(["\n", " the", ".", ",", "def"], rng.randint(1, 2))
        body["include_stop_str_in_output"] = rng.random() < 0.5
    if rng.random() < 0.2:
        body["stop_token_ids"] = rng.sample(ids, 2)
    if rng.random() < 0.2:
        body["min_tokens"] = rng.randint(0, body["max_tokens"])
    if rng.random() < 0.1:
        body["ignore_eos"] = True
    if rng.random() < 0.25:
        body["logit_bias"] = {str(t): rng.choice([-100.0, -5.0, 3.0, 8.0]) for t in rng.sample(ids, 3)}
    if rng.random() < 0.3:
        body["presence_penalty"] = rng.choice([-0.5, 0.6])
        body["frequency_penalty"] = rng.choice([0.0, 0.4])
    if rng.random() < 0.2:
        body["repetition_penalty"] = rng.choice([0.9, 1.2, 1.8])
    if rng.random() < 0.15:
        body["allowed_token_ids"] = rng.sample(ids, len(ids) // 2)
    if rng.random() < 0.15:
        body["bad_words"] = rng.sample(["the", "fox", "return", "a", "sea"], 2)
    structured = rng.random()
    if structured < 0.07:
        body["guided_regex"] = r"[a-z]+( [a-z]+)*\."
    elif structured < 0.14:
        body["guided_choice"] = ["yes", "no", "maybe not"]
    elif structured < 0.2:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    if rng.random() < 0.3:
        if chat:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 3)
        else:
            body["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.6:
        body["gamma"] = rng.choice([1, 2, 4, 6, "auto"])
    if rng.random() < 0.3:
        body["tree"] = rng.choice(["chain", "auto", 4, 8])
    body["stream"] = rng.random() < 0.3
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.2:  # drawn last: the earlier draws are the same as without these options
        body["return_token_ids"] = True
    if rng.random() < 0.2:
        body["return_tokens_as_token_ids"] = True
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def _post(url: str, path: str, body: dict) -> dict:
    """The response as one JSON body: streamed chunks are put back together."""
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=120) as client:
        if not body["stream"]:
            r = client.post(url + path, json=body, headers=headers)
            assert r.status_code == 200, (r.status_code, r.text[:400], body)
            return r.json()
        choices: dict[int, dict] = {}
        usage = stats = None
        with client.stream("POST", url + path, json=body, headers=headers) as r:
            assert r.status_code == 200, (r.status_code, r.read()[:400], body)
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, (chunk, body)
                usage = chunk.get("usage") or usage
                stats = chunk.get("specdec") or stats
                for c in chunk["choices"]:
                    acc = choices.setdefault(c["index"], {"text": "", "finish_reason": None, "logprobs": []})
                    piece = c.get("delta", {}).get("content") if "delta" in c else c.get("text")
                    acc["text"] += piece or ""
                    if "token_ids" in c:
                        acc["token_ids"] = acc.get("token_ids", []) + c["token_ids"]
                    acc["finish_reason"] = c.get("finish_reason") or acc["finish_reason"]
                    if c.get("logprobs"):
                        acc["logprobs"].append(c["logprobs"])
        for acc in choices.values():  # one chunk per round: rounds differ with the drafter, tokens do not
            acc["logprobs"] = _joined(acc["logprobs"])
        return {"choices": [choices[i] for i in sorted(choices)], "usage": usage, "specdec": stats}


def _joined(parts: list[dict]) -> dict | None:
    """Streamed log-probabilities as one response holds them: the chunks' lists end to end."""
    if not parts:
        return None
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, list):
                out.setdefault(key, []).extend(value)
            else:
                out[key] = value
    return out


def _view(response: dict) -> list[tuple]:
    """What a deterministic request must reproduce: per choice its text, finish reason and
    log-probabilities; and the token counts."""
    out = []
    for c in response["choices"]:
        text = c["message"]["content"] if "message" in c else c["text"]
        out.append((text, c["finish_reason"], json.dumps(c.get("logprobs"), sort_keys=True), c.get("token_ids")))
    usage = response.get("usage") or {}
    out.append((usage.get("prompt_tokens"), usage.get("completion_tokens")))
    return out


def _deterministic(body: dict) -> bool:
    if body["temperature"] == 0:
        return True
    return "seed" in body and body.get("method", "coupled") == "coupled"


def test_speculating_servers_answer_what_plain_decoding_answers(servers):
    ids = _vocabulary_sample(servers[0])
    rng = random.Random(20261201)
    requests = [_request(rng, ids) for _ in range(N_REQUESTS)]
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        answers = [list(pool.map(lambda req, url=url: _post(url, *req), requests)) for url in servers]
    compared = 0
    drafted = {name: [0, 0] for name in DRAFTERS}  # proposed, accepted over the compared requests
    trees = {name: 0 for name in DRAFTERS}  # tree rounds over the compared requests
    for i, (path, body) in enumerate(requests):
        ref = answers[0][i]
        assert len(ref["choices"]) == body.get("n", 1)
        if body.get("return_token_ids"):  # every generated token's id, streamed or not
            assert sum(len(c["token_ids"]) for c in ref["choices"]) == ref["usage"]["completion_tokens"], body
        for name, got in zip(DRAFTERS, (a[i] for a in answers[1:])):
            assert len(got["choices"]) == body.get("n", 1), (name, body)
            assert (got.get("usage") or {}).get("completion_tokens", 0) <= body["max_tokens"] * body.get("n", 1)
            if _deterministic(body):
                assert _view(got) == _view(ref), (name, path, body)
                compared += 1
                drafted[name][0] += got["specdec"]["draft_tokens_proposed"]
                drafted[name][1] += got["specdec"]["draft_tokens_accepted"]
                trees[name] += got["specdec"]["tree_rounds"]
    assert compared >= N_REQUESTS  # most requests are deterministic ones, each compared on 3 servers
    for name, (proposed, accepted) in drafted.items():  # the drafters drafted, and were often wrong
        assert proposed >= 100 and 0.1 * proposed < accepted < 0.9 * proposed, (name, proposed, accepted)
    assert trees["ngram"] >= 20 and trees["lookahead"] >= 20, trees  # tree requests verified trees
    assert trees["layerskip:2"] == 0  # a self-speculative view has no tree pass: its tree requests draft chains


def test_a_bad_tree_is_a_400(servers):
    for tree in (0, 65, "bushy"):
        r = httpx.post(servers[1] + "/v1/completions", json={"prompt": "a", "max_tokens": 2, "tree": tree},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 400 and "tree" in r.json()["error"]["message"], (tree, r.text)
