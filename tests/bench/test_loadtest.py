"""The load test script's pure helpers (the script itself runs outside CI)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

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


def _gen(session, index, tokens=(1, 2, 3), error=None, wall=1.0):
    return lt.Generation(session, index, f"p{session}", "greedy", 0.0, 0, 0.0, wall, list(tokens), verify_calls=2, error=error)


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
