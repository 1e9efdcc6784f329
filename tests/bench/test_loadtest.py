"""The load test script's pure helpers (the script itself runs outside CI)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "loadtest.py"
spec = importlib.util.spec_from_file_location("loadtest", SCRIPT)
lt = importlib.util.module_from_spec(spec)
sys.modules["loadtest"] = lt  # dataclasses look their module up there
spec.loader.exec_module(lt)

BASES = [("code/a", "def a():\n", False), ("chat/b", "Say hi.", True)]


def test_every_session_and_generation_gets_its_own_prompt():
    prompts = [lt.session_prompt(s, k, BASES) for s in range(32) for k in range(5)]
    assert len({text for _, text, _ in prompts}) == len({pid for pid, _, _ in prompts}) == 32 * 5
    assert lt.session_prompt(1, 0, BASES) == ("chat/b#request 1-0", "(request 1-0) Say hi.", True)
    assert lt.session_prompt(0, 0, BASES)[1] == "# request 0-0\ndef a():\n"


def test_sampling_alternates_greedy_and_seeded_coupled():
    assert lt.session_sampling(0, 3, 0.8) == ("greedy", 0.0, 0)
    wire, t, seed = lt.session_sampling(3, 2, 0.8)
    assert (wire, t) == ("coupled", 0.8) and seed != lt.session_sampling(3, 3, 0.8)[2] != lt.session_sampling(5, 2, 0.8)[2]


def test_rss_trend():
    mib = 2**20
    flat_then_growing = [(t, 100 * mib) for t in range(0, 60)] + [(t, (100 + (t - 60)) * mib) for t in range(60, 121)]
    r = lt.rss_trend(flat_then_growing)
    assert r["samples"] == 121 and r["min_mib"] == 100 and r["max_mib"] == 160 and r["last_mib"] == 160
    assert r["second_half_slope_mib_per_min"] == pytest.approx(60.0)  # 1 MiB/s
    assert 0 < r["slope_mib_per_min"] < 60
    assert lt.rss_trend([]) == {"samples": 0}
    assert lt.rss_trend([(0.0, mib)])["slope_mib_per_min"] is None


def _gen(session, index, tokens=(1, 2, 3), error=None, wall=1.0, retries=0, recreates=0, wire="greedy", temperature=0.0, seed=0):
    return lt.Generation(session, index, f"p{session}", wire, temperature, seed, 0.0, wall, list(tokens), verify_calls=2,
                         retries=retries, session_recreates=recreates, error=error)


def test_summarize_pick_and_compare():
    gens = [_gen(0, 0), _gen(0, 1), _gen(1, 0, error="RemoteError: inconsistent verdict"), _gen(1, 1), _gen(2, 0, wall=3.0)]
    s = lt.summarize(gens, 10.0, 4)
    assert s["generations_completed"] == 4 and s["generations_failed"] == 1
    assert s["errors_by_kind"] == {"RemoteError": 1} and "session 1 #0" in s["error_messages"][0]
    assert s["sessions_with_a_completed_generation"] == 3 and (s["completed_per_session_min"], s["completed_per_session_max"]) == (0, 2)
    assert s["tokens"] == 12 and s["tokens_per_s"] == pytest.approx(1.2) and s["verify_calls"] == 8
    picked = lt.pick_for_check(gens, 3)
    assert [(g.session, g.index) for g in picked] == [(0, 0), (2, 0), (0, 1)]  # first of each session, then seconds
    assert lt.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert lt.first_difference([1, 2, 3], [1, 5, 3]) == 1 and lt.first_difference([1, 2], [1, 2, 3]) == 2


def test_markdown_prints_the_command_and_verdict():
    gens = [_gen(0, 0)]
    summary = {
        "command": "python scripts/loadtest.py --out x --sessions 1",
        "config": {"target": "t", "draft": "d", "sessions": 1, "duration_s": 10.0, "max_new_tokens": 3, "gamma": 4,
                   "temperature": 0.8, "rtt_ms": 0.0, "server_threads": 1, "edge_threads": 1, "rss_interval_s": 1.0, "check": 1},
        "load_wall_s": 10.2, "load": lt.summarize(gens, 10.2, 1), "server_rss": lt.rss_trend([(0.0, 2**20), (1.0, 2**21)]),
        "check": {"checked": 1, "matched": 0, "mismatches_count": 1,
                  "mismatches": [{"session": 0, "index": 0, "prompt_id": "p0", "first_difference": 2}]},
        "passed": False,
    }
    md = lt.markdown(summary)
    assert "Command: `python scripts/loadtest.py --out x --sessions 1`" in md and "**FAIL**" in md
    assert "| 0 | 0 | p0 | 2 |" in md


def test_stream_summary_quantiles_and_failures():
    ok = lt.Stream(0, 0, "p", 0.0, 0, 0.0, wall_s=1.0, ttft_s=0.2, gaps_s=[0.1, 0.3], text="ab", tokens=5)
    ok2 = lt.Stream(1, 0, "p", 0.8, 9, 0.0, wall_s=1.0, ttft_s=0.4, gaps_s=[0.2], text="c", tokens=3)
    bad = lt.Stream(2, 0, "p", 0.0, 0, 0.0, error="RuntimeError: HTTP 503")
    s = lt.summarize_streams([ok, ok2, bad], 4.0)
    assert (s["completed"], s["failed"], s["tokens"], s["tokens_per_s"]) == (2, 1, 8, 2.0)
    assert s["ttft_p50_s"] == 0.4 and s["inter_token_p50_s"] == 0.2 and s["inter_token_p95_s"] == 0.3
    assert s["error_messages"] == ["stream 2 #0: RuntimeError: HTTP 503"]


MIB = 2**20


# ----------------------------------------------------------------------------- pure bookkeeping


def test_a_sessions_prompts_go_round_the_bases_from_generation_to_generation():
    """Session 0's generations 0 and 1 take different base prompts (not the same base every time)."""
    assert lt.session_prompt(0, 0, BASES)[0].startswith("code/a#")
    assert lt.session_prompt(0, 1, BASES)[0].startswith("chat/b#") and lt.session_prompt(0, 1, BASES)[2] is True


def test_the_second_half_trend_starts_at_the_midpoint_sample():
    """Samples at 0..4 s: the midpoint (2 s) belongs to the second half's fit."""
    samples = [(0.0, 100 * MIB), (1.0, 100 * MIB), (2.0, 130 * MIB), (3.0, 100 * MIB), (4.0, 100 * MIB)]
    r = lt.rss_trend(samples)
    assert r["second_half_slope_mib_per_min"] == pytest.approx(-15 * 60.0)  # (2,130) (3,100) (4,100): -15 MiB/s


def test_retries_and_recreated_sessions_count_failed_generations_too():
    gens = [_gen(0, 0, retries=1), _gen(1, 0, error="RemoteError: x", retries=2, recreates=1)]
    s = lt.summarize(gens, 1.0, 2)
    assert (s["retries"], s["session_recreates"]) == (3, 1)


def test_latency_is_that_of_completed_generations_only():
    gens = [_gen(0, 0, wall=1.0), _gen(0, 1, wall=1.0), _gen(1, 0, wall=50.0, error="ReadError: cut")]
    s = lt.summarize(gens, 1.0, 2)
    assert s["latency_p50_s"] == s["latency_p95_s"] == 1.0


def test_at_most_max_error_messages_are_kept_verbatim():
    gens = [_gen(0, k, error=f"RemoteError: {k}") for k in range(lt.MAX_ERROR_MESSAGES + 5)]
    s = lt.summarize(gens, 1.0, 1)
    assert s["generations_failed"] == lt.MAX_ERROR_MESSAGES + 5 and len(s["error_messages"]) == lt.MAX_ERROR_MESSAGES
    bad = [lt.Stream(0, k, "p", 0.0, 0, 0.0, error=f"RuntimeError: {k}") for k in range(lt.MAX_ERROR_MESSAGES + 3)]
    assert len(lt.summarize_streams(bad, 1.0)["error_messages"]) == lt.MAX_ERROR_MESSAGES


def test_a_generation_whose_session_was_recreated_is_always_checked_and_counts_in_n():
    """Re-created sessions' generations first (whatever n), then the others up to n in all."""
    gens = [_gen(0, 0), _gen(1, 0), _gen(0, 1), _gen(1, 1, recreates=1), _gen(2, 2, recreates=1)]
    picked = lt.pick_for_check(gens, 3)
    assert [(g.session, g.index) for g in picked] == [(1, 1), (2, 2), (0, 0)]
    assert [(g.session, g.index) for g in lt.pick_for_check(gens, 1)] == [(1, 1), (2, 2)]


def test_a_failed_stream_counts_as_failed_even_with_tokens():
    ok = lt.Stream(0, 0, "p", 0.0, 0, 0.0, wall_s=1.0, ttft_s=0.1, text="a", tokens=1)
    cut = lt.Stream(1, 0, "p", 0.0, 0, 0.0, ttft_s=0.1, text="ab", tokens=2, error="IncompleteStream: cut")
    s = lt.summarize_streams([ok, cut], 1.0)
    assert (s["completed"], s["failed"], s["tokens"]) == (1, 1, 1)


# ----------------------------------------------------------------------------- the reference checks


class FakeEngine:
    """engine.generate as the target alone: a fixed answer; records the rule each check asked for."""

    def __init__(self, token_ids=(1, 2, 3), text="abc"):
        self.methods = []
        self.token_ids, self.text = list(token_ids), text
        self.target = SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda text, add_special_tokens=False: [len(text)]))

    def generate(self, ids, cfg, method):
        self.methods.append((method, cfg.temperature, cfg.seed))
        return SimpleNamespace(token_ids=self.token_ids, text=self.text)


def test_the_check_regenerates_greedy_and_coupled_sessions_with_their_own_rule_and_seed():
    gens = [_gen(0, 0), _gen(1, 0, wire="coupled", temperature=0.8, seed=17)]
    engine = FakeEngine()
    args = SimpleNamespace(check=4, max_new_tokens=3)
    out = lt._check(args, gens, {(0, 0): [5], (1, 0): [6]}, engine)
    assert sorted(engine.methods) == [("coupled", 0.8, 17), ("greedy", 0.0, 0)]
    assert (out["checked"], out["matched"], out["mismatches_count"]) == (2, 2, 0)


def test_a_checked_output_that_differs_is_counted_as_a_mismatch():
    gens = [_gen(0, 0, tokens=(1, 2, 9))]
    out = lt._check(SimpleNamespace(check=1, max_new_tokens=3), gens, {(0, 0): [5]}, FakeEngine())
    assert out["mismatches_count"] == 1 and out["mismatches"][0]["first_difference"] == 2 and out["matched"] == 0


def _stream(j, k, text="abc", temperature=0.0, seed=0, restarts=0):
    return lt.Stream(j, k, f"s{j}", temperature, seed, 0.0, wall_s=1.0, text=text, tokens=3, restarts=restarts)


def test_streams_are_checked_with_their_rule_whole_text_and_restarted_ones_first():
    """Odd streams sample with the coupled rule (seeded): the check asks for it; a streamed text that
    is only a prefix of the reference's is a mismatch; a restarted stream is always checked."""
    engine = FakeEngine(text="abc")
    streams = [_stream(0, 0), _stream(1, 0, temperature=0.8, seed=9), _stream(0, 1, text="ab"), _stream(1, 1, restarts=1)]
    inputs = {(s.stream, s.index): "x" for s in streams}
    out = lt._check_streams(SimpleNamespace(check=2, max_new_tokens=3), streams, inputs, engine)
    assert out["checked"] == 2 and [m["index"] for m in out["mismatches"]] == []  # (1, 1) restarted, then (0, 0)
    assert engine.methods == [("greedy", 0.0, 0), ("greedy", 0.0, 0)]
    engine = FakeEngine(text="abc")
    out = lt._check_streams(SimpleNamespace(check=4, max_new_tokens=3), streams, inputs, engine)
    assert ("coupled", 0.8, 9) in engine.methods
    assert out["checked"] == 4 and out["mismatches"] == [{"stream": 0, "index": 1, "prompt_id": "s0"}]


# ----------------------------------------------------------------------------- reading a stream


class FakeResponse:
    def __init__(self, lines, status=200):
        self.lines, self.status_code = lines, status

    def iter_lines(self):
        yield from self.lines

    def read(self):
        return b"busy"


class FakeClient:
    """client.stream(...) answering each call with the next list of SSE lines (or an exception)."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.calls = 0

    @contextlib.contextmanager
    def stream(self, method, url, json):
        self.calls += 1
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        yield answer


def _sse(*chunks, done=True):
    lines = [f"data: {json.dumps(c)}" for c in chunks]
    return lines + (["data: [DONE]"] if done else [])


def _text(t):
    return {"choices": [{"index": 0, "text": t}]}


def _new_stream():
    return lt.Stream(0, 0, "p", 0.0, 0, 0.0)


def test_a_stream_is_read_to_its_done_event_with_its_usage_and_pieces():
    st = _new_stream()
    body = _sse(_text("a"), _text(""), _text("bc"), {"choices": [], "usage": {"completion_tokens": 3}})
    lt._stream_read(FakeClient(FakeResponse(body)), {"url": "u"}, {}, st, 0.0)
    assert st.text == "abc" and st.tokens == 3 and st.ttft_s is not None and len(st.gaps_s) == 1


def test_a_stream_cut_before_done_or_with_an_error_event_raises():
    with pytest.raises(lt.IncompleteStream):
        lt._stream_read(FakeClient(FakeResponse(_sse(_text("a"), done=False))), {"url": "u"}, {}, _new_stream(), 0.0)
    with pytest.raises(RuntimeError, match="overloaded"):
        lt._stream_read(FakeClient(FakeResponse(_sse(_text("a"), {"error": {"message": "overloaded"}}))), {"url": "u"}, {},
                        _new_stream(), 0.0)
    with pytest.raises(RuntimeError, match="HTTP 503: busy"):
        lt._stream_read(FakeClient(FakeResponse([], status=503)), {"url": "u"}, {}, _new_stream(), 0.0)


def test_a_cut_stream_is_issued_again_only_under_ray_at_most_twice_from_scratch():
    """--ray: a stream cut by a dying replica starts over (its text not doubled), twice at most;
    without --ray the cut is the stream's error."""
    cut = lt.IncompleteStream("cut")
    st = _new_stream()
    client = FakeClient(FakeResponse(_sse(_text("ab"), done=False)), FakeResponse(_sse(_text("ab"))))
    lt._stream_once(client, {"url": "u"}, {}, st, 0.0, SimpleNamespace(ray=True))
    assert (st.text, st.restarts, client.calls) == ("ab", 1, 2)
    st = _new_stream()
    with pytest.raises(lt.IncompleteStream):
        lt._stream_once(FakeClient(cut, cut, cut, FakeResponse(_sse(_text("x")))), {"url": "u"}, {}, st, 0.0, SimpleNamespace(ray=True))
    assert st.restarts == 2
    with pytest.raises(lt.IncompleteStream):
        lt._stream_once(FakeClient(cut, FakeResponse(_sse(_text("x")))), {"url": "u"}, {}, _new_stream(), 0.0, SimpleNamespace(ray=False))


# ----------------------------------------------------------------------------- options, verdict, server


def _args(*extra):
    return lt.parse_args(["--out", "x", *extra])


def test_the_options_are_checked_and_gamma_read_as_a_number():
    assert _args("--gamma", "6").gamma == 6 and _args("--gamma", "auto").gamma == "auto"
    for bad in (["--rss-interval", "0"], ["--check", "-1"], ["--ray", "--kill-replica-after", "10", "--duration", "10"],
                ["--kill-replica-after", "5"], ["--ray", "--compare-serialised"]):
        with pytest.raises(SystemExit):
            _args(*bad)
    assert _args("--ray", "--kill-replica-after", "9.5", "--duration", "10").kill_replica_after == 9.5


def test_the_reference_target_is_loaded_as_the_server_reports_it():
    assert lt.target_of("int8 (onednn)") == ("int8", "onednn") and lt.target_of("float32") == ("float32", "auto")
    assert lt.target_of(None) == ("auto", "auto") and lt.target_of("q4 (fbgemm)") == ("q4", "fbgemm")


def _phase(gens=(), kill=None):
    return {"gens": list(gens), "streams": [], "load_wall_s": 1.0, "inputs": {(g.session, g.index): [1] for g in gens},
            "stream_inputs": {}, "batching": True, "server_draft": "none", "rss": [], "kill": kill, "precision": "float32"}


def test_a_phase_passes_only_with_some_generation_and_a_kill_that_happened():
    args = _args("--check", "2")
    assert lt.phase_summary(args, _phase([_gen(0, 0)]), FakeEngine(), "cmd")["passed"]
    assert not lt.phase_summary(args, _phase([]), FakeEngine(), "cmd")["passed"]  # nothing completed: no evidence
    ray = _args("--ray", "--check", "2")
    assert not lt.phase_summary(ray, _phase([_gen(0, 0)], kill={"error": "RuntimeError: none"}), FakeEngine(), "cmd")["passed"]
    assert lt.phase_summary(ray, _phase([_gen(0, 0)], kill={"victim_pid": 1, "at_s": 1.0, "replicas_before": 2}),
                            FakeEngine(), "cmd")["passed"]


class _Started(Exception):
    pass


@pytest.fixture
def servers(monkeypatch):
    """run_phase's servers, stopped at start(): the (draft, argv) each would have been started with."""
    from specdec.bench import network

    started = []

    class FakeServer:
        def __init__(self, target, draft, *, threads, emulation):
            self.argv = ["serve", target, "--draft", draft, "--threads", str(threads)]

        def start(self):
            started.append(self.argv)
            raise _Started

    monkeypatch.setattr(network, "CloudServer", FakeServer)
    return started


def test_the_serialised_server_is_started_with_no_batching_and_its_own_int8_kernel(servers):
    args = _args("--int8-kernel", "fbgemm", "--serialised-int8-kernel", "onednn", "--server-threads", "3")
    for batching in (True, False):
        with pytest.raises(_Started):
            lt.run_phase(args, {}, batching=batching)
    batched, serial = servers
    assert "--no-batching" not in batched and batched[batched.index("--int8-kernel") + 1] == "fbgemm"
    assert "--no-batching" in serial and serial[serial.index("--int8-kernel") + 1] == "onednn"
    assert batched[batched.index("--threads") + 1] == "3"


def test_the_server_drafts_only_when_openai_streams_need_it(servers):
    for extra in ([], ["--openai-streams", "2"], ["--draft", "ngram", "--openai-streams", "2"]):
        with pytest.raises(_Started):
            lt.run_phase(_args(*extra), {}, batching=True)
    drafts = [argv[argv.index("--draft") + 1] for argv in servers]
    assert drafts == ["none", "smollm2-135m-draft", "none"]
