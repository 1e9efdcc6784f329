"""The edge against a server that answers wrongly: every reply is checked before the edge acts on it.

A small HTTP server in a thread plays the session API, correct by default, with one field of one
reply spoilt per case.  Each case used to end the edge with a traceback, a hang, or — worst — exit 0
with output the server had no right to produce (ids past the edge's vocabulary printed as no text;
a lossy rule reported lossless; another seed reported as the one sent).  Each must now be a
:class:`RemoteError` naming what was wrong, within the round's time budget.
"""

from __future__ import annotations

import contextlib
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specdec.models.registry import DATA_DIR, load_tokenizer
from specdec.remote.client import RemoteConfig, RemoteError
from specdec.remote.edge import generate_remote
from specdec.sampling import SamplingConfig
from toy_drafters import FixedDrafter

VOCAB = 49152


class _Fake(BaseHTTPRequestHandler):
    mode = "ok"

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_DELETE(self) -> None:  # noqa: N802 - http.server's name
        self._send(200, b"{}")

    def do_POST(self) -> None:  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        mode = type(self).mode
        if self.path == "/v1/sessions":
            reply = {"session_id": "s1", "model": "fake", "wire": req["wire"], "method": req["method"], "lossless": True,
                     "seed": req["seed"], "vocab_size": VOCAB, "max_context": 2048, "max_length": 2048, "max_gamma": 64,
                     "prompt_ids": req["prompt_ids"], "prefill_ms": 1.0}
            if mode == "lossy":
                reply.update(wire="lossy-scalar", method="lossy_resample_p", lossless=False)
            elif mode == "seed":
                reply["seed"] = req["seed"] + 1
            elif mode == "huge_vocab":
                reply["vocab_size"] = 10**6
            elif mode == "no_room":
                reply["max_length"] = len(req["prompt_ids"])
            elif mode == "not_json":
                return self._send(200, b"<html>ok</html>", "text/html")
            elif mode == "html_error":
                return self._send(500, b"<html><body><h1>500</h1>\n\x1b[2K\x1b[32mall good\x1b[0m</body></html>", "text/html")
            elif mode == "drip":
                self.send_response(200)
                self.send_header("Content-Length", "100000")
                self.end_headers()
                for _ in range(40):  # 10 s: well past the test's bound, so a client that waits it out fails
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.25)
                return None
            return self._send(201, json.dumps(reply).encode())
        tokens = [60000] if mode == "huge_vocab" else [5]
        reply = {"seq": req["seq"], "num_accepted": 0, "tokens": tokens, "next_token": tokens[-1],
                 "metrics": {"target_ms": 1.0, "server_ms": 1.0, "verify_ms": 1.0}}
        if req.get("parents") is not None:
            reply["path"] = []  # a tree round: the accepted nodes (none)
        if mode == "negative":
            reply.update(num_accepted=-1, tokens=[])  # len(tokens) == n + 1 held, and the loop never moved
        elif mode == "bool_token":
            reply.update(tokens=[True], next_token=True)
        elif mode == "nan":
            reply["metrics"]["target_ms"] = float("nan")
        elif mode == "committed":
            reply["metrics"]["committed"] = 99
        elif mode == "wrong_accepted" and req.get("draft_tokens"):  # "accepts" a token the edge did not draft
            reply.update(num_accepted=1, tokens=[req["draft_tokens"][0] + 1, 5])
        elif mode == "bad_path" and req.get("parents"):  # node 1 alone: its parent, node 0, is not on the path
            reply.update(num_accepted=1, tokens=[req["draft_tokens"][1], 5], path=[1])
        return self._send(200, json.dumps(reply).encode())


@contextlib.contextmanager
def _served(handler: type[_Fake]):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def fake():
    with _served(_Fake) as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DATA_DIR / "smollm2-135m-draft")


def _run(url: str, tokenizer, mode: str, budget: float = 5.0, **drafting):
    _Fake.mode = mode
    cfg = RemoteConfig(url=url, timeout_s=budget, retry_budget_s=budget, backoff_s=0.01)
    return generate_remote([1, 2, 3], SamplingConfig(temperature=0.0, max_new_tokens=3, seed=7), cfg,
                           drafter=FixedDrafter((7, 8)) if drafting else None, tokenizer=tokenizer, **drafting)


def test_a_correct_server_is_followed(fake, tokenizer):
    out = _run(fake, tokenizer, "ok")
    assert out.token_ids == [5, 5, 5] and out.remote["lossless"]
    _Fake.mode = "ok"  # the largest seed there is comes back as it went
    cfg = RemoteConfig(url=fake, timeout_s=5.0, retry_budget_s=5.0)
    seed = (1 << 63) - 1
    out = generate_remote([1, 2, 3], SamplingConfig(temperature=1.0, max_new_tokens=2, seed=seed), cfg, drafter=None,
                          tokenizer=tokenizer)
    assert out.remote["seed"] == seed


@pytest.mark.parametrize("mode, says", [
    ("huge_vocab", "sent token id 60000 in round 0, outside the vocabulary [0, 49152) the edge decodes"),
    ("lossy", "verifies with wire 'lossy-scalar' and rule 'lossy_resample_p' (lossless: False), not the greedy"),
    ("seed", "samples with seed 8, not the 7 the edge sent"),
    ("no_room", "has a bad 'max_length': 3"),
    ("negative", "has a bad 'num_accepted': -1"),
    ("bool_token", "has a bad 'tokens': [true]"),
    ("nan", "has a bad 'target_ms': NaN"),
    ("not_json", "the server's reply to the session's creation is not JSON"),
    ("committed", "the server's session holds 99 committed tokens but the edge has 1"),
])
def test_a_wrong_reply_is_an_error_naming_it(fake, tokenizer, mode, says):
    with pytest.raises(RemoteError) as refused:
        _run(fake, tokenizer, mode)
    assert says in str(refused.value)


@pytest.mark.parametrize("mode, drafting", [
    ("wrong_accepted", {"gamma": 2}),  # a chain's accepted prefix that is not the draft's
    ("bad_path", {"gamma": 2, "tree": 2}),  # a tree path that does not start at the root
])
def test_a_verdict_that_does_not_fit_the_draft_is_an_error(fake, tokenizer, mode, drafting):
    out = _run(fake, tokenizer, "ok", **drafting)  # the same drafter, answered correctly (nothing accepted)
    assert out.token_ids == [5, 5, 5]
    with pytest.raises(RemoteError, match="the server's verdict for round 0 is inconsistent with the draft"):
        _run(fake, tokenizer, mode, **drafting)


def test_a_reply_that_drips_is_bounded_by_the_round_budget(fake, tokenizer):
    """Headers at once, then a byte every 0.25 s for 10 s: each read came within httpx's read
    timeout, so the reply went on for as long as the server liked.  The budget ends it at ~1.75 s
    (1.5 s and the next byte); the bound leaves a loaded machine 4 s more and is still well short
    of the drip's 10 s."""
    started = time.perf_counter()
    with pytest.raises(RemoteError, match="did not answer within 1.5 s"):
        _run(fake, tokenizer, "drip", budget=1.5)
    assert time.perf_counter() - started < 6.0


def test_an_error_page_is_printed_on_one_line_without_escapes(fake, tokenizer):
    with pytest.raises(RemoteError) as refused:
        _run(fake, tokenizer, "html_error")
    message = str(refused.value)
    # the tags and control characters gone, the rest on one line (the escapes' printable tails stay)
    assert message == "the server refused the session: HTTP 500: 500 [2K [32mall good [0m", message


class _Spoilt(_Fake):
    """_Fake, with its JSON replies changed after the fact (``spoil``: a mode name of this class)."""

    spoil: str | None = None

    def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
        spoil = type(self).spoil
        if spoil is not None and content_type == "application/json" and body != b"{}":
            reply = json.loads(body)
            if "session_id" in reply:
                if spoil == "other_prompt":
                    reply["prompt_ids"] = reply["prompt_ids"][:-1] + [reply["prompt_ids"][-1] + 1]
                elif spoil == "lossless_lie":  # the rule asked for, but said to be lossy
                    reply["lossless"] = False
            elif spoil == "float_path" and reply.get("path") is not None and "parents" in self._last:
                reply.update(num_accepted=1, tokens=[7, 5], path=[0.0])
            elif spoil == "negative_token":
                reply.update(tokens=[-1], next_token=-1)
            elif spoil == "accepts_past_the_draft":
                reply.update(num_accepted=3, tokens=[7, 8, 9, 5])
            body = json.dumps(reply).encode()
        super()._send(status, body, content_type)

    def do_POST(self) -> None:  # noqa: N802 - remembers the request's keys for _send
        length = int(self.headers["Content-Length"])
        raw = self.rfile.read(length)
        self._last = json.loads(raw or b"{}")
        self.rfile = io.BytesIO(raw)
        super().do_POST()


@pytest.fixture(scope="module")
def spoilt():
    with _served(_Spoilt) as url:
        yield url
    _Spoilt.spoil = None


@pytest.mark.parametrize("spoil, drafting, says", [
    ("other_prompt", {}, "the server's session does not hold the prompt the edge sent"),
    ("lossless_lie", {}, "(lossless: False), not the greedy / greedy the edge asked for"),
    ("float_path", {"gamma": 2, "tree": 2}, "the server's verdict for round 0 is inconsistent with the draft"),
    ("accepts_past_the_draft", {"gamma": 2}, "has a bad 'num_accepted': 3"),
    ("negative_token", {}, "sent token id -1 in round 0, outside the vocabulary"),
])
def test_a_reply_spoilt_after_the_fact_is_an_error_naming_it(spoilt, tokenizer, spoil, drafting, says):
    _Spoilt.spoil = None
    assert _run(spoilt, tokenizer, "ok", **drafting).token_ids == [5, 5, 5]  # unspoilt: followed
    _Spoilt.spoil = spoil
    try:
        with pytest.raises(RemoteError) as refused:
            _run(spoilt, tokenizer, "ok", **drafting)
    finally:
        _Spoilt.spoil = None
    assert says in str(refused.value)
