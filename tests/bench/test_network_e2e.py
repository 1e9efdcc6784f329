"""The edge-cloud bench end to end with real processes (server, delay proxy, edge worker).

The served target is the bundled 15.7 M-parameter SmolLM2 draft (fast on a CPU); settings are tiny.
Only one-sided timing is asserted (a ping through a 30 ms proxy takes at least 30 ms).
"""

from __future__ import annotations

import httpx
import pytest

from serverproc import ServerProcess
from specdec.bench import report, runner
from specdec.bench.edge_worker import stream_completion
from specdec.bench.workloads import BUILTIN
from specdec.remote.delay_proxy import ThreadedProxy

MODEL = "smollm2-135m-draft"
KEY = "bench-net-key"


def test_streaming_wire_byte_count_matches_the_bytes_forwarded():
    body = {"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with ServerProcess.cli("--target", MODEL, "--draft", "none", "--api-key", KEY) as srv:
        with ThreadedProxy("127.0.0.1", srv.port, 0.0) as proxy, httpx.Client(timeout=60) as client:
            res = stream_completion(client, proxy.url, {"Authorization": f"Bearer {KEY}"}, body)
            assert res.tokens == 8 and res.finish_reason == "length" and res.text
            assert 0 < res.ttft_s <= res.wall_s
            assert res.bytes_up < res.wire_bytes_up and res.bytes_down < res.wire_bytes_down
            assert (proxy.stats.bytes_up, proxy.stats.bytes_down) == (res.wire_bytes_up, res.wire_bytes_down)


@pytest.fixture(scope="module")
def result():
    cfg = runner.BenchConfig(
        target=MODEL, draft=MODEL, prompts=(BUILTIN[0],), modes=("edge_cloud", "cloud_streaming"),
        temperatures=(0.0, 1.0), wires=("greedy", "sparse-q"), rtts=(0.0, 30.0), max_new_tokens=8,
        rtt_emulation="proxy", threads=1,
    )
    return runner.run(cfg, progress=False)


def test_bench_runs_edge_cloud_and_streaming_over_the_proxy(result):
    samples = result["samples"]
    keys = sorted((s["rtt_ms"], s["temperature"], s["mode"], s["method"]) for s in samples)
    assert keys == sorted((r, t, m, w) for r in (0.0, 30.0) for t, m, w in (
        (0.0, "cloud_streaming", "cloud_streaming"), (0.0, "edge_cloud", "greedy"),
        (1.0, "cloud_streaming", "cloud_streaming"), (1.0, "edge_cloud", "sparse-q")))
    for s in samples:
        assert s["generated_tokens"] > 0 and s["wire_bytes_up"] > s["bytes_up"] > 0 and s["wire_bytes_down"] > s["bytes_down"] > 0
        assert s["emulation"] == "proxy" and s["lossless"]
        if s["rtt_ms"] == 30.0:
            assert s["ping_ms"] >= 30.0
    edge = [s for s in samples if s["mode"] == "edge_cloud"]
    assert all(s["cloud_calls"] >= 1 and s["draft_tokens_proposed"] > 0 for s in edge)
    assert {s["draft_temperature_factor"] for s in edge} == {0.85}  # the shipped draft's calibration (auto)
    # greedy over the wire is exact: the same text as the cloud decoding alone
    by = {(s["rtt_ms"], s["method"]): s["text_sha1"] for s in samples if s["temperature"] == 0.0}
    assert by[(0.0, "greedy")] == by[(0.0, "cloud_streaming")] and by[(30.0, "greedy")] == by[(30.0, "cloud_streaming")]
    net = result["network"]
    assert net["rtt_emulation"] == "proxy" and net["rtts_ms"] == [0.0, 30.0]
    assert set(net["proxy_totals"]) == {"cloud_streaming+edge_cloud@0ms", "cloud_streaming+edge_cloud@30ms"}
    assert net["servers"]["cloud_streaming+edge_cloud"]["draft"] == "none"
    assert net["servers"]["cloud_streaming+edge_cloud"]["rss_peak_bytes"] > 0


def test_bench_report_of_a_real_run(result, tmp_path):
    out = report.write(result, tmp_path, make_plots=False)
    groups = {(g.mode, g.method, g.rtt_ms) for g in out["network"]}
    assert ("edge_cloud", "greedy", 30.0) in groups and ("cloud_streaming", "cloud_streaming", 0.0) in groups
    greedy = [g for g in out["network"] if g.method == "greedy"]
    assert all(g.same_text == g.compared == 1 and g.speedup_vs_streaming for g in greedy)
    md = (tmp_path / "README.md").read_text()
    assert "RTT emulation: **proxy**" in md and "sampled at 0.85 × T" in md
    precision = result["config"]["draft_precision"]  # recorded by the run, said by the report
    assert precision and (precision == "auto" or f"(draft dtype auto = {precision}, sampled at 0.85 × T)" in md)
