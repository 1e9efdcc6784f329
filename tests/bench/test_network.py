"""The edge-cloud bench modes: planning, RTT-emulation detection and the metrics (synthetic samples, no timing)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from types import SimpleNamespace

import httpx
import pytest

from specdec.bench import edge_worker, netreport, network, report
from specdec.bench.edge_worker import chunked_wire_bytes, interleaved_settings
from specdec.bench.journal import Kept
from specdec.errors import SpecdecError
from specdec.remote.client import _head_bytes_response

WIRES = ["greedy", "coupled", "sparse-q", "lossy-scalar"]


def test_wire_validity_and_settings():
    assert network.wire_valid("greedy", 0.0) and not network.wire_valid("greedy", 1.0)
    assert all(network.wire_valid(w, 0.7) and not network.wire_valid(w, 0.0) for w in WIRES[1:])
    assert list(network.network_settings("edge_cloud", [0.0, 1.0], WIRES, ["auto", "4"])) == [
        (0.0, "greedy", "auto"), (0.0, "greedy", "4"),
        (1.0, "coupled", "auto"), (1.0, "coupled", "4"), (1.0, "sparse-q", "auto"), (1.0, "sparse-q", "4"),
        (1.0, "lossy-scalar", "auto"), (1.0, "lossy-scalar", "4"),
    ]
    assert list(network.network_settings("cloud_streaming", [0.0, 1.0], WIRES, ["auto", "4"])) == [(0.0, None, None), (1.0, None, None)]
    assert list(network.network_settings("cloud_streaming_spec", [0.0], WIRES, ["auto", "4"])) == [(0.0, None, "auto"), (0.0, None, "4")]
    # 3 prompts x 2 repeats x 4 RTTs x (1 + 3) settings
    assert network.count("edge_cloud", 3, 2, [0, 20, 50, 100], [0.0, 1.0], WIRES, ["auto"]) == 3 * 2 * 4 * 4
    assert network.count("cloud_streaming", 3, 2, [0, 20], [0.0, 1.0], WIRES, ["auto"]) == 3 * 2 * 2 * 2


def test_groups_share_a_plain_server_and_interleave_baseline_first():
    assert network.groups(["edge_cloud", "cloud_streaming_spec", "cloud_streaming"]) == [
        ["cloud_streaming", "edge_cloud"], ["cloud_streaming_spec"]]
    assert network.groups(["edge_cloud"]) == [["edge_cloud"]]
    assert network.server_draft(["cloud_streaming", "edge_cloud"], "d") == "none"
    assert network.server_draft(["cloud_streaming_spec"], "d") == "d"
    assert interleaved_settings(["cloud_streaming", "edge_cloud"], 1.0, ["greedy", "coupled"], ["auto"]) == [
        ("cloud_streaming", None, None), ("edge_cloud", "coupled", "auto")]
    # the caller's order of modes (its baseline first), not sorted
    assert [m for m, _, _ in interleaved_settings(["cloud_streaming", "edge_cloud", "cloud_streaming_spec"], 1.0,
                                                  ["coupled"], ["auto"])] == ["cloud_streaming", "edge_cloud",
                                                                              "cloud_streaming_spec"]


def test_chunked_wire_bytes():
    # "a\r\n" + 10 bytes + "\r\n", "100\r\n" + 256 + "\r\n", empty chunks are never written, "0\r\n\r\n"
    assert chunked_wire_bytes([10, 256, 0]) == (1 + 2 + 10 + 2) + (3 + 2 + 256 + 2) + 5
    assert chunked_wire_bytes([]) == 5


def _script(tmp_path, rc: int, message: str):
    path = tmp_path / f"netem-{rc}.sh"
    path.write_text(f'#!/usr/bin/env bash\n[ "$1" = check ] || exit 9\necho "{message}"\nexit {rc}\n')
    return path


def test_detect_prefers_netem_and_falls_back_to_the_proxy(tmp_path):
    ok = network.detect("auto", _script(tmp_path, 0, "netem available"))
    assert (ok.kind, ok.detail) == ("netem", "netem available") and ok.script
    no = network.detect("auto", _script(tmp_path, 3, "netem unavailable: no qdisc; proxy instead"))
    assert (no.kind, no.detail) == ("proxy", "netem unavailable: no qdisc; proxy instead")
    assert network.detect("proxy").kind == "proxy"
    with pytest.raises(SpecdecError, match="no qdisc"):
        network.detect("netem", _script(tmp_path, 3, "netem unavailable: no qdisc"))
    with pytest.raises(SpecdecError, match="unknown RTT emulation"):
        network.detect("tc")


# ----------------------------------------------------------------------------- metrics


def _edge(prompt, tps, *, wire="greedy", t=0.0, rtt=20.0, gen=20, calls=5, up=400, down=600, wup=1400, wdown=1300,
          prop=20, acc=15, ping=21.0, net=22.0, lossless=True, seed=0):
    return {"mode": "edge_cloud", "method": wire, "wire": wire, "gamma": "auto", "temperature": t, "prompt_id": prompt,
            "category": "code", "seed": seed, "rtt_ms": rtt, "emulation": "proxy", "ping_ms": ping, "generated_tokens": gen,
            "wall_s": gen / tps, "tokens_per_s": tps, "ttft_s": 0.1, "cloud_calls": calls, "bytes_up": up, "bytes_down": down,
            "wire_bytes_up": wup, "wire_bytes_down": wdown, "draft_tokens_proposed": prop, "draft_tokens_accepted": acc,
            "net_rtt_ms": net, "round_ms": net + 5, "lossless": lossless}


def _stream(prompt, tps, *, mode="cloud_streaming", t=0.0, rtt=20.0, gen=20, seed=0):
    plain = mode == "cloud_streaming"
    return {"mode": mode, "method": mode, "wire": None, "gamma": None if plain else "auto", "temperature": t,
            "prompt_id": prompt, "category": "code", "seed": seed, "rtt_ms": rtt, "emulation": "proxy", "ping_ms": 20.5,
            "generated_tokens": gen, "wall_s": gen / tps, "tokens_per_s": tps, "ttft_s": 0.05,
            "cloud_calls": gen if plain else None, "bytes_up": 300, "bytes_down": 4000, "wire_bytes_up": 600,
            "wire_bytes_down": 4500, "lossless": True}


def _samples():
    rows = []
    for p, ratio in (("a", 2.0), ("b", 1.0), ("c", 1.5)):
        for rtt, base in ((20.0, 40.0), (100.0, 20.0)):
            rows.append({**_stream(p, base, rtt=rtt), "text_sha1": f"text-{p}"})
            rows.append({**_edge(p, base * ratio, rtt=rtt), "text_sha1": f"text-{p}" if p != "b" else "other"})
    rows.append(_stream("a", 30.0, mode="cloud_streaming_spec"))
    return rows


def test_aggregate_network_pairs_speedups_and_sums_per_token():
    stats = {(g.mode, g.method, g.rtt_ms): g for g in netreport.aggregate_network(_samples())}
    edge = stats[("edge_cloud", "greedy", 20.0)]
    assert edge.n == 3 and edge.speedup_vs_streaming == pytest.approx(1.5)  # median of 2, 1, 1.5
    assert edge.tokens_per_s_median == pytest.approx(60.0)
    assert edge.cloud_calls_per_token == pytest.approx(15 / 60) and edge.tokens_per_call == pytest.approx(4.0)
    assert edge.bytes_up_per_token == pytest.approx(20.0) and edge.bytes_down_per_token == pytest.approx(30.0)
    assert edge.wire_bytes_up_per_token == pytest.approx(70.0) and edge.wire_bytes_down_per_token == pytest.approx(65.0)
    assert edge.acceptance == pytest.approx(0.75) and edge.ping_ms == 21.0 and edge.net_rtt_ms == 22.0
    assert edge.label == "edge_cloud/greedy" and edge.emulation == "proxy"
    assert (edge.same_text, edge.compared) == (2, 3)  # prompt b's edge text differs from the cloud's
    base = stats[("cloud_streaming", "cloud_streaming", 100.0)]
    assert base.speedup_vs_streaming == pytest.approx(1.0) and base.cloud_calls_per_token == pytest.approx(1.0)
    spec = stats[("cloud_streaming_spec", "cloud_streaming_spec", 20.0)]
    assert spec.speedup_vs_streaming == pytest.approx(30.0 / 40.0)
    assert spec.cloud_calls_per_token is None and spec.tokens_per_call is None  # not reported by a stream
    # local aggregation ignores the network samples
    assert report.aggregate(_samples()) == []


def test_speedup_pairs_by_rtt_temperature_prompt_and_seed():
    rows = [_stream("a", 10.0, seed=0), _stream("a", 50.0, seed=1), _edge("a", 20.0, seed=0),
            _edge("a", 20.0, wire="coupled", t=1.0), _edge("b", 20.0, rtt=50.0)]
    stats = {(g.method, g.temperature, g.rtt_ms): g for g in netreport.aggregate_network(rows)}
    assert stats[("greedy", 0.0, 20.0)].speedup_vs_streaming == pytest.approx(2.0)  # seed 0 with seed 0
    assert stats[("coupled", 1.0, 20.0)].speedup_vs_streaming is None  # no baseline at T=1
    assert stats[("greedy", 0.0, 50.0)].speedup_vs_streaming is None  # none at 50 ms


def test_bytes_by_wire_pools_rtts():
    per = {(b.label, b.temperature): b for b in netreport.bytes_by_wire(_samples() + [_edge("a", 9.0, wire="sparse-q", t=1.0, up=9000, gen=30)])}
    assert per[("edge_cloud/greedy", 0.0)].payload_up == pytest.approx(20.0)
    assert per[("edge_cloud/sparse-q", 1.0)].payload_up == pytest.approx(300.0)
    assert per[("cloud_streaming", 0.0)].wire_down == pytest.approx(225.0)


def test_lossy_rows_are_labelled():
    [g] = [g for g in netreport.aggregate_network([_edge("a", 10.0, wire="lossy-scalar", t=1.0, lossless=False)])]
    assert not g.lossless and "LOSSY" in g.label


def test_write_network_only_report(tmp_path):
    result = {"config": {"target": "t", "draft": "d", "draft_dtype": "auto", "prompts": [{"category": "code"}],
                         "max_new_tokens": 20, "repeats": 1, "seed": 0, "top_p": None, "repetition_penalty": None,
                         "batch_invariant": True, "command": "specdec bench --modes edge_cloud"},
              "samples": _samples(), "processes": {"cloud_streaming+edge_cloud@20ms": {"rss_peak_bytes": 2**20, "seconds": 3}},
              "machine": {"cpu": "test"},
              "network": {"rtt_emulation": "proxy", "detail": "netem unavailable: test", "rtts_ms": [20.0, 100.0],
                          "proxy_totals": {"cloud_streaming+edge_cloud@20ms": {"connections": 1, "bytes_up": 10, "bytes_down": 20}},
                          "servers": {"cloud_streaming+edge_cloud": {"draft": "none", "rss_peak_bytes": 2**21}}}}
    out = report.write(result, tmp_path)
    md = (tmp_path / "README.md").read_text()
    assert "## Edge–cloud split (emulated RTT)" in md and "RTT emulation: **proxy**" in md and "netem unavailable: test" in md
    assert "| edge_cloud/greedy | auto | 0 | 20 | 21.0 / 22.0 | 60.0 [50.0–70.0] | 1.50 |" in md and md.count("| 2/3 |") == 2
    assert "## Summary" not in md  # no local modes ran
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["network"]["rtt_emulation"] == "proxy" and len(saved["network_groups"]) == len(out["network"]) == 5
    names = {p.split("/")[-1] for p in out["plots"]}
    assert names == {"edge_cloud_tokens_per_s_vs_rtt.png", "edge_cloud_bytes_per_token.png"}


def test_same_text_is_only_counted_at_temperature_zero():
    rows = [{**_stream("a", 10.0, t=1.0), "text_sha1": "x"}, {**_edge("a", 20.0, t=1.0), "text_sha1": "x"}]
    [edge] = [g for g in netreport.aggregate_network(rows) if g.mode == "edge_cloud"]
    assert edge.speedup_vs_streaming == pytest.approx(2.0)
    assert edge.same_text is None and edge.compared is None  # sampled text need not match


def test_measured_rtts_are_medians_over_generations():
    # net RTT 10, 20, 60 ms: median 20 (mean 30); rounds are net + 5: median 25; pings 21, 22, 90: median 22
    rows = [_edge(p, 20.0, net=net, ping=ping) for p, net, ping in (("a", 10.0, 21.0), ("b", 20.0, 22.0), ("c", 60.0, 90.0))]
    [g] = netreport.aggregate_network(rows)
    assert g.net_rtt_ms == pytest.approx(20.0) and g.round_ms == pytest.approx(25.0) and g.ping_ms == pytest.approx(22.0)


def _row(mode, prompt, tps, *, t=0.0, rtt=20.0, text="same", lossless=True, ttft=0.1, gamma=None, seed=0):
    method = "greedy" if mode == "edge_cloud" else mode
    return {"mode": mode, "method": method, "wire": None, "gamma": gamma, "temperature": t, "prompt_id": prompt,
            "seed": seed, "rtt_ms": rtt, "emulation": "proxy", "ping_ms": 20.0, "generated_tokens": 20,
            "tokens_per_s": tps, "ttft_s": ttft, "cloud_calls": 20, "bytes_up": 100, "bytes_down": 200,
            "wire_bytes_up": 300, "wire_bytes_down": 400, "lossless": lossless, "text_sha1": text}


def _by_mode(rows):
    return {g.mode: g for g in netreport.aggregate_network(rows)}


def test_the_speedup_and_ttft_are_medians_over_prompts():
    rows = [_row("cloud_streaming", p, 10.0) for p in "abc"]
    rows += [_row("edge_cloud", "a", 10.0, ttft=0.1), _row("edge_cloud", "b", 10.0, ttft=0.1),
             _row("edge_cloud", "c", 40.0, ttft=1.0)]
    edge = _by_mode(rows)["edge_cloud"]
    assert edge.speedup_vs_streaming == pytest.approx(1.0)  # median of 1, 1, 4 (the mean is 2)
    assert edge.ttft_median_s == pytest.approx(0.1)


def test_a_baseline_that_produced_nothing_is_left_out_of_the_speedup():
    rows = [_row("cloud_streaming", "a", 0.0), _row("cloud_streaming", "b", 10.0),
            _row("edge_cloud", "a", 10.0), _row("edge_cloud", "b", 30.0)]
    assert _by_mode(rows)["edge_cloud"].speedup_vs_streaming == pytest.approx(3.0)


def test_same_text_is_counted_for_lossless_modes_only_and_never_for_the_baseline():
    """At T = 0: a lossy wire's text need not match (not compared); one lossy row makes its group
    lossy; the baseline is not compared with itself."""
    rows = [_row("cloud_streaming", p, 10.0, text=f"t{p}") for p in "ab"]
    rows += [_row("edge_cloud", "a", 20.0, text="ta", lossless=False), _row("edge_cloud", "b", 20.0, text="x")]
    stats = _by_mode(rows)
    edge, base = stats["edge_cloud"], stats["cloud_streaming"]
    assert not edge.lossless and "(LOSSY)" in edge.label
    assert (edge.same_text, edge.compared) == (None, None)
    assert (base.same_text, base.compared) == (None, None)
    rows[2]["lossless"] = True
    assert (_by_mode(rows)["edge_cloud"].same_text, _by_mode(rows)["edge_cloud"].compared) == (1, 2)


def test_gammas_sort_numerically_then_the_policies_and_rtts_ascend():
    assert sorted(["auto", "10", "4", "guide", "2"], key=netreport.gamma_order) == ["2", "4", "10", "auto", "guide"]
    rows = [_row("cloud_streaming", "a", 10.0, rtt=rtt) for rtt in (100.0, 5.0, 20.0)]
    rows += [_row("edge_cloud", "a", 10.0, gamma=g) for g in ("auto", "10", "4")]
    stats = netreport.aggregate_network(rows)
    assert [(g.mode, g.gamma, g.rtt_ms) for g in stats] == [
        ("edge_cloud", "4", 20.0), ("edge_cloud", "10", 20.0), ("edge_cloud", "auto", 20.0),
        ("cloud_streaming", None, 5.0), ("cloud_streaming", None, 20.0), ("cloud_streaming", None, 100.0)]


def test_the_report_prints_ttft_in_ms_and_the_proxys_bytes_each_way():
    rows = [_row("cloud_streaming", "a", 10.0, ttft=0.25), _row("edge_cloud", "a", 20.0, ttft=0.25)]
    lines = netreport.markdown(netreport.aggregate_network(rows), {
        "rtt_emulation": "proxy", "proxy_totals": {"edge": {"connections": 3, "bytes_up": 111, "bytes_down": 222}}})
    edge_line = next(line for line in lines if line.startswith("| edge_cloud/greedy"))
    assert "| 250 |" in edge_line and "| 2.00 |" in edge_line
    assert "| edge | 3 | 111 | 222 |" in lines
    assert [b.label for b in netreport.bytes_by_wire(rows)] == ["cloud_streaming", "edge_cloud/greedy"]


EVENTS = [b'data: {"choices":[{"text":"","finish_reason":null}]}\n\n',
          b'data: {"choices":[{"text":"He","finish_reason":null}]}\n\n',
          b'data: {"choices":[{"text":"","finish_reason":null}]}\n\n',
          b'data: {"choices":[{"text":"llo","finish_reason":null}]}\n\n',
          b'data: {"choices":[{"text":"","finish_reason":"length"}],"usage":{"completion_tokens":2}}\n\n',
          b"data: [DONE]\n\n"]


def test_a_streamed_completion_is_read_timed_and_counted_as_sent(monkeypatch):
    """Events split across reads are put together; the text, tokens and finish reason are read off
    them; TTFT is the arrival of the first non-empty text (not of an empty event before it, not of
    the last text), wall time that of the finish; payload and wire bytes both ways."""
    raw = b"".join(EVENTS)
    cut = len(EVENTS[0])  # three reads: an event without text; "He" and part of "llo"; the rest and the finish
    cut2 = cut + len(EVENTS[1]) + len(EVENTS[2]) + 10
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["body"] = request.read()
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=iter([raw[:cut], raw[cut:cut2], raw[cut2:]]))

    ticks = iter(range(1000))
    monkeypatch.setattr(edge_worker, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    body = {"prompt": [1, 2], "max_tokens": 2, "stream": True}
    hooks = {"response": [lambda resp: seen.update(resp=resp)]}
    with httpx.Client(transport=httpx.MockTransport(handler), event_hooks=hooks) as client:
        res = edge_worker.stream_completion(client, "http://cloud", {"Authorization": "Bearer k"}, body)
    assert (res.text, res.tokens, res.finish_reason) == ("Hello", 2, "length")
    assert (res.ttft_s, res.wall_s) == (2.0, 3.0)  # clock ticks: the start, then one per read
    assert res.bytes_up == len(seen["body"]) == len(json.dumps(body, separators=(",", ":")))
    sizes = [len(ev) for ev in EVENTS]
    assert res.bytes_down == sum(sizes)
    assert res.wire_bytes_down == _head_bytes_response(seen["resp"]) + edge_worker.chunked_wire_bytes(sizes)


@pytest.mark.parametrize("plain", [True, False])
def test_the_streaming_baselines_send_gamma_as_a_number_and_count_calls_only_for_the_plain_server(plain):
    """``cloud_streaming`` (plain server): one cloud call per token; ``cloud_streaming_spec``: calls
    not reported (None); a numeric γ goes out as a number, a policy name as it is."""
    from specdec.sampling import SamplingConfig

    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.read()))
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=iter(EVENTS))

    job = SimpleNamespace(draft="smollm2-135m-draft", api_key="k", url="http://cloud")
    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        _, generate = edge_worker._stream_runner(job, client, plain)
        sampling = SamplingConfig(temperature=0.0, seed=3, max_new_tokens=2)
        row = generate([1, 2], sampling, None, "4")
        generate([1, 2], sampling, None, "auto")
    assert [b["gamma"] for b in bodies] == [4, "auto"] and "top_p" not in bodies[0]
    assert row["generated_tokens"] == 2 and row["text_sha1"] == edge_worker.text_sha1("Hello")
    assert (row["cloud_calls"], row["tokens_per_call"]) == ((2, 1.0) if plain else (None, None))


def test_the_measured_ping_is_the_median_round_trip(monkeypatch):
    """Three ``GET /health`` round trips of 1, 1 and 10 (fake) seconds: 1000 ms, not the mean."""
    ticks = iter([0.0, 1.0, 1.0, 2.0, 2.0, 12.0])
    monkeypatch.setattr(edge_worker, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    with httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(200, json={}))) as client:
        assert edge_worker.ping_ms(client, "http://cloud") == pytest.approx(1000.0)


def test_the_netem_check_detail_is_its_last_stdout_line(tmp_path):
    """netem.sh check may print progress first and warnings on stderr: its answer is stdout's last line."""
    script = tmp_path / "netem.sh"
    script.write_text('#!/usr/bin/env bash\necho "probing tc"\necho "netem unavailable: no qdisc" \n'
                      'echo "a warning" >&2\nexit 3\n')
    em = network.detect("auto", script)
    assert (em.kind, em.detail) == ("proxy", "netem unavailable: no qdisc")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_peak_rss_is_in_bytes():
    """VmHWM is in kB (1024 bytes): the peak agrees with getrusage's ru_maxrss (kB on Linux) to 1 %."""
    peak = network.peak_rss(os.getpid())
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert peak is not None and abs(peak - maxrss) <= 0.01 * maxrss
    assert network.peak_rss(2 ** 22 + 12345) is None  # no such process


def test_thread_env_limits_every_pool():
    env = network.thread_env(3)
    assert (env["OMP_NUM_THREADS"], env["MKL_NUM_THREADS"], env["TOKENIZERS_PARALLELISM"]) == ("3", "3", "false")


NETEM = network.Emulation("netem", "ok", "/x/netem.sh")
PROXY = network.Emulation("proxy", "asked for")


def _server(emulation, **kw):
    server = network.CloudServer("t", "d", threads=2, emulation=emulation, **kw)
    server._log.close()
    return server


def test_the_cloud_server_gets_every_option_and_runs_in_the_cloud_namespace_under_netem():
    server = _server(NETEM, draft_dtype="bf16", draft_vocab="map", draft_temperature_factor="0.8", kv_dtype="int8")
    argv = server.argv
    assert argv[:4] == ["ip", "netns", "exec", network.NETEM_CLOUD_NS] and server.host == network.NETEM_CLOUD_IP
    opts = dict(zip(argv[argv.index("--host"):][::2], argv[argv.index("--host") + 1:][::2]))
    assert opts["--host"] == network.NETEM_CLOUD_IP and opts["--port"] == str(server.port)
    assert (opts["--target"], opts["--draft"], opts["--draft-dtype"], opts["--draft-vocab"]) == ("t", "d", "bf16", "map")
    assert (opts["--draft-temperature-factor"], opts["--kv-dtype"]) == ("0.8", "int8")
    assert server.env["SPECDEC_API_KEY"] == server.api_key and server.api_key not in argv
    local = _server(PROXY)
    assert local.argv[0] == sys.executable and local.host == "127.0.0.1" and local.url.startswith("http://127.0.0.1:")


def test_the_edge_runs_in_the_edge_namespace_under_netem_only():
    assert network.Link(_server(NETEM), 20.0).edge_prefix == ["ip", "netns", "exec", network.NETEM_EDGE_NS]
    assert network.Link(_server(PROXY), 20.0).edge_prefix == []


def test_a_stopped_proxys_totals_are_its_last_stopped_line_without_the_marker():
    link = network.Link(_server(PROXY), 20.0)
    out = '{"listening": 1}\nnot json\n{"stopped": true, "bytes_up": 5, "bytes_down": 7, "connections": 1}\n'
    link.proc = SimpleNamespace(send_signal=lambda sig: None, communicate=lambda timeout: (out, ""))
    assert link.stop() == {"bytes_up": 5, "bytes_down": 7, "connections": 1}


def test_only_the_speculative_streaming_server_drafts():
    assert network.server_draft(["cloud_streaming"], "d") == "none"
    assert network.server_draft(["edge_cloud"], "d") == "none"
    assert network.server_draft(["cloud_streaming_spec"], "d") == "d"


def test_a_server_record_counts_workers_only_when_it_ran_more_than_once():
    one = network.server_process([{"rss_peak_bytes": 5, "seconds": 2.0}])
    assert one == {"rss_peak_bytes": 5, "seconds": 2.0}
    two = network.server_process([{"rss_peak_bytes": 9, "seconds": 2.0}, {"rss_peak_bytes": 5, "seconds": 1.0}])
    assert two == {"rss_peak_bytes": 9, "seconds": 3.0, "workers": 2}


@pytest.fixture
def fake_processes(monkeypatch):
    """CloudServer and Link that start nothing: what run_group hands them is recorded, and netem.sh
    calls too (recorded, not run)."""
    seen = {"servers": [], "netem": []}

    def start(self):
        seen["servers"].append(self)
        return self

    def stop(self):
        self._log.close()
        return {"rss_peak_bytes": 11}

    monkeypatch.setattr(network.CloudServer, "start", start)
    monkeypatch.setattr(network.CloudServer, "stop", stop)
    monkeypatch.setattr(network.Link, "start", lambda self: self)
    monkeypatch.setattr(network.Link, "stop", lambda self: {"bytes_up": int(self.rtt_ms)})
    monkeypatch.setattr(network.subprocess, "run", lambda argv, **kw: seen["netem"].append(argv[2:]))
    return seen


def _run_group(run_worker, journal=None, **kw):
    record = network.NetworkRun("proxy", "asked for", [0.0, 30.0])
    processes: dict = {}
    args = dict(target="t", draft="d", draft_dtype="auto", draft_temperature_factor="0.9", threads=2,
                rtts=[0.0, 30.0], emulation=PROXY, job={"k": 1}, run_worker=run_worker, record=record,
                processes=processes, journal=journal)
    network.run_group(["cloud_streaming", "edge_cloud"], **{**args, **kw})
    return record, processes


def test_run_group_passes_each_rtt_and_the_thread_limit_on(fake_processes):
    """Each RTT's worker gets that RTT, the link's URL, the server's key and ``threads`` threads; the
    plain server (no drafter) gets no draft temperature factor; each proxy and the server report
    their totals to the journal when they stop."""
    calls, totals = [], []

    def worker(job, env, prefix, name):
        calls.append((job["rtt_ms"], job["url"], job["api_key"], env["OMP_NUM_THREADS"], prefix, name))
        return {"done": True}

    journal = SimpleNamespace(totals=lambda name, t: totals.append((name, t)))
    record, processes = _run_group(worker, journal=journal)
    [server] = fake_processes["servers"]
    assert [c[0] for c in calls] == [0.0, 30.0] and all(c[1] == server.url and c[2] == server.api_key for c in calls)
    assert {c[3] for c in calls} == {"2"} and all(c[4] == [] for c in calls)
    argv = server.argv
    assert argv[argv.index("--draft") + 1] == "none" and argv[argv.index("--draft-temperature-factor") + 1] == "auto"
    assert record.servers["cloud_streaming+edge_cloud"] == {"draft": "none", "rss_peak_bytes": 11}
    assert record.proxy_totals == {"cloud_streaming+edge_cloud@0ms": {"bytes_up": 0}, "cloud_streaming+edge_cloud@30ms": {"bytes_up": 30}}
    names = [n for n, _ in totals]
    assert names == ["cloud_streaming+edge_cloud@0ms", "cloud_streaming+edge_cloud@30ms", "cloud_streaming+edge_cloud:server"]


def test_a_failing_worker_reports_why_the_server_exited(fake_processes, monkeypatch):
    """A worker that fails because the server died: the error is the server's last words."""
    monkeypatch.setattr(network.CloudServer, "failure", lambda self: "the cloud server exited with 1: out of memory")

    def worker(job, env, prefix, name):
        raise SpecdecError("connection refused")

    with pytest.raises(SpecdecError, match="out of memory"):
        _run_group(worker)


def test_the_tokens_per_s_quartiles_interpolate_linearly():
    """tok/s 10, 20, 40, 80: q25 at position 0.75 -> 17.5, q75 at 2.25 -> 50 (numpy's default),
    not the mirrored interpolation (which agrees on three evenly spaced values)."""
    rows = [_edge(p, tps) for p, tps in zip("abcd", (10.0, 20.0, 40.0, 80.0))]
    [g] = netreport.aggregate_network(rows)
    assert g.tokens_per_s_q25 == pytest.approx(17.5) and g.tokens_per_s_q75 == pytest.approx(50.0)


def test_a_group_that_generated_no_tokens_has_no_per_token_figures():
    """Every generation stopped at once (0 tokens): the per-token ratios are None, not a ZeroDivisionError."""
    rows = [{**_edge(p, 10.0), "generated_tokens": 0} for p in "ab"]
    [g] = netreport.aggregate_network(rows)
    assert g.cloud_calls_per_token is None and g.bytes_up_per_token is None and g.wire_bytes_down_per_token is None
    assert g.tokens_per_call == pytest.approx(0.0)
    [b] = netreport.bytes_by_wire(rows)
    assert b.payload_up is None and b.wire_down is None


def test_a_measured_round_trip_of_zero_ms_counts_in_the_median():
    """Loopback without emulation: net RTTs 0, 0, 5 ms -> median 0 (a 0.0 is a measurement, not a missing one)."""
    rows = [_edge(p, 20.0, net=net, ping=ping) for p, net, ping in (("a", 0.0, 0.0), ("b", 0.0, 0.0), ("c", 5.0, 9.0))]
    [g] = netreport.aggregate_network(rows)
    assert g.net_rtt_ms == 0.0 and g.ping_ms == 0.0 and g.round_ms == pytest.approx(5.0)


def test_a_figure_missing_from_one_row_is_missing_for_the_group():
    """One row without wire bytes or cloud calls (None): the group's figure is None ('–'), not the
    other rows' sum spread over every row's tokens."""
    rows = [_edge("a", 10.0), {**_edge("b", 10.0), "wire_bytes_up": None, "cloud_calls": None}]
    [g] = netreport.aggregate_network(rows)
    assert g.wire_bytes_up_per_token is None and g.cloud_calls_per_token is None and g.tokens_per_call is None
    assert g.bytes_up_per_token == pytest.approx(20.0)  # the others still count: 800 B / 40 tokens
    [b] = netreport.bytes_by_wire(rows)
    assert b.wire_up is None and b.payload_up == pytest.approx(20.0)


def test_rows_that_do_not_record_lossless_are_lossless():
    """Older rows without a 'lossless' field: lossless (no '(LOSSY)' label) and their text compared."""
    rows = [{k: v for k, v in r.items() if k != "lossless"}
            for r in (_row("cloud_streaming", "a", 10.0), _row("edge_cloud", "a", 20.0))]
    edge = {g.mode: g for g in netreport.aggregate_network(rows)}["edge_cloud"]
    assert edge.lossless and "LOSSY" not in edge.label
    assert (edge.same_text, edge.compared) == (1, 1)


def test_a_group_that_drafted_nothing_has_no_acceptance():
    """No draft tokens proposed (0, not missing): acceptance is None, not a ZeroDivisionError."""
    [g] = netreport.aggregate_network([_edge("a", 10.0, prop=0, acc=0)])
    assert g.acceptance is None


def test_gammas_sort_before_rtts_within_a_mode():
    """Within a mode and wire, rows sort by γ (numbers, then policies) and then by RTT ascending."""
    rows = [{**_row("edge_cloud", "a", 10.0, gamma=g, rtt=rtt)} for g in ("auto", "4") for rtt in (100.0, 20.0)]
    assert [(g.gamma, g.rtt_ms) for g in netreport.aggregate_network(rows)] == [
        ("4", 20.0), ("4", 100.0), ("auto", 20.0), ("auto", 100.0)]


def test_groups_sort_by_temperature_first_then_mode():
    """All of T = 0 (edge_cloud before the baselines) comes before any row of T = 1."""
    rows = [_row(m, "a", 10.0, t=t) for t in (1.0, 0.0) for m in ("cloud_streaming", "edge_cloud")]
    assert [(g.temperature, g.mode) for g in netreport.aggregate_network(rows)] == [
        (0.0, "edge_cloud"), (0.0, "cloud_streaming"), (1.0, "edge_cloud"), (1.0, "cloud_streaming")]


def test_same_text_compares_only_prompts_whose_baseline_recorded_its_text():
    """A baseline row without a text digest (None) is not a comparison the edge row failed."""
    rows = [_row("cloud_streaming", "a", 10.0, text="ta"), _row("cloud_streaming", "b", 10.0, text=None),
            _row("edge_cloud", "a", 20.0, text="ta"), _row("edge_cloud", "b", 20.0, text="tb")]
    edge = {g.mode: g for g in netreport.aggregate_network(rows)}["edge_cloud"]
    assert (edge.same_text, edge.compared) == (1, 1)


def test_bytes_by_wire_leaves_the_local_modes_out_and_sorts_by_temperature_first():
    """Only the network rows are pooled (a local row has no bytes); T = 0 before T = 1, then mode."""
    local = {"mode": "speculative", "method": "block", "temperature": 0.0, "generated_tokens": 20}
    rows = [local] + [_row(m, "a", 10.0, t=t) for t in (1.0, 0.0) for m in ("edge_cloud", "cloud_streaming")]
    assert [(b.label, b.temperature) for b in netreport.bytes_by_wire(rows)] == [
        ("cloud_streaming", 0.0), ("edge_cloud/greedy", 0.0), ("cloud_streaming", 1.0), ("edge_cloud/greedy", 1.0)]


def test_no_network_rows_no_edge_cloud_section():
    """A run without the network modes gets no edge-cloud section, even with network info recorded."""
    assert netreport.markdown([], {"rtt_emulation": "proxy", "servers": {"x": {"draft": "none"}}}) == []


def test_the_servers_peak_rss_is_printed_in_mib():
    rows = [_row("cloud_streaming", "a", 10.0)]
    lines = netreport.markdown(netreport.aggregate_network(rows), {
        "servers": {"cloud_streaming+edge_cloud": {"draft": "none", "rss_peak_bytes": 3 * 2**20},
                    "cloud_streaming_spec": {"draft": "d", "rss_peak_bytes": None}}})
    assert "| cloud_streaming+edge_cloud | none | 3 |" in lines and "| cloud_streaming_spec | d | – |" in lines


def _cells(lines, label):
    header = next(line for line in lines if line.startswith("| mode |"))
    row = next(line for line in lines if line.startswith(f"| {label}"))
    return dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in row.split("|")]))


def test_each_figure_is_printed_in_its_own_column():
    """tokens/call, calls/token and the down bytes (payload and wire) land under their headers;
    a same-text comparison with nothing to compare prints '–', not 0/0."""
    rows = [_row("cloud_streaming", "a", 10.0, text=None),
            {**_row("edge_cloud", "a", 20.0), "cloud_calls": 5, "wire_bytes_up": 700}]
    cells = _cells(netreport.markdown(netreport.aggregate_network(rows), None), "edge_cloud/greedy")
    assert cells["tokens/call"] == "4.00" and cells["cloud calls/token"] == "0.250"
    assert cells["B up/token payload (wire)"] == "5.0 (35.0)" and cells["B down/token payload (wire)"] == "10.0 (20.0)"
    assert cells["same text"] == "–"


def test_the_speculative_server_is_compared_too_and_generated_tokens_are_a_mean():
    """At T = 0 cloud_streaming_spec is a lossless mode like edge_cloud: its text is compared with
    the baseline's.  generated_tokens_mean is the mean (10, 10, 40 -> 20), not the median."""
    rows = [_row("cloud_streaming", "a", 10.0, text="ta"), _row("cloud_streaming_spec", "a", 20.0, text="ta")]
    spec = {g.mode: g for g in netreport.aggregate_network(rows)}["cloud_streaming_spec"]
    assert (spec.same_text, spec.compared) == (1, 1)
    [g] = netreport.aggregate_network([{**_edge(p, 10.0), "generated_tokens": n} for p, n in zip("abc", (10, 10, 40))])
    assert g.generated_tokens_mean == pytest.approx(20.0)


GROUP = "cloud_streaming+edge_cloud"


# ----------------------------------------------------------------------------- network.py


def test_a_netem_check_that_hangs_falls_back_to_the_proxy_and_says_why(monkeypatch):
    """``netem.sh check`` that runs past its timeout is a failed check (auto: the proxy), not a crash."""
    def run(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], 60)

    monkeypatch.setattr(network.subprocess, "run", run)
    em = network.detect("auto", network.Path("/x/netem.sh"))
    assert em.kind == "proxy" and em.detail.startswith("netem.sh check failed")


def test_the_cloud_server_accepts_many_sessions():
    """The bench's server allows 256 sessions (every prompt × wire × RTT opens one; the default is lower)."""
    argv = _server(PROXY).argv
    assert argv[argv.index("--max-sessions") + 1] == "256"


def test_a_running_server_has_no_failure_and_an_exited_one_shows_its_last_five_log_lines():
    server = network.CloudServer("t", "d", threads=1, emulation=PROXY)
    try:
        server.proc = SimpleNamespace(poll=lambda: None, returncode=None)
        assert server.failure() is None  # still running: a worker's own error stands
        server._log.write("\n".join(f"line {i}" for i in range(8)) + "\n")
        server.proc = SimpleNamespace(poll=lambda: 1, returncode=1)
        assert server.failure() == "the cloud server exited with 1: " + "\n".join(f"line {i}" for i in range(3, 8))
    finally:
        server._log.close()


def test_proxy_totals_of_a_resumed_bench_add_up():
    assert network.add_totals([{"bytes_up": 5, "connections": 1}, {"bytes_up": 7, "bytes_down": 2}]) == \
        {"bytes_up": 12, "connections": 1, "bytes_down": 2}


def test_a_server_whose_peak_was_never_read_has_no_peak():
    """No peak RSS known (the process had exited): None, not 0 bytes."""
    assert network.server_process([{"rss_peak_bytes": None, "seconds": 1.0}])["rss_peak_bytes"] is None


def _ok(job, env, prefix, name):
    return {"done": True}


def test_run_group_hands_the_draft_vocabulary_and_the_cache_dtype_to_the_server(fake_processes):
    _run_group(_ok, draft_vocab="full", kv_dtype="float16")
    argv = fake_processes["servers"][0].argv
    assert argv[argv.index("--draft-vocab") + 1] == "full" and argv[argv.index("--kv-dtype") + 1] == "float16"


def test_each_edge_worker_is_told_the_emulation_and_runs_in_the_edge_namespace_under_netem(fake_processes):
    """Under netem the namespace is set up before the server starts and torn down after; each edge
    worker runs inside the edge namespace and records which emulation ran."""
    calls = []

    def worker(job, env, prefix, name):
        calls.append((job["emulation"], prefix))
        return {"done": True}

    _run_group(worker, emulation=NETEM)
    assert calls == [("netem", ["ip", "netns", "exec", network.NETEM_EDGE_NS])] * 2
    assert fake_processes["netem"] == [["up", "0"], ["down"]]
    calls.clear()
    _run_group(worker)
    assert calls == [("proxy", [])] * 2


def test_a_proxy_that_reported_nothing_writes_no_totals_to_the_journal(fake_processes, monkeypatch):
    """Under netem there is no proxy (Link.stop gives {}): the journal gets the server's totals only."""
    monkeypatch.setattr(network.Link, "stop", lambda self: {})
    written = []
    journal = SimpleNamespace(totals=lambda name, t: written.append(name))
    _run_group(_ok, emulation=NETEM, journal=journal)
    assert written == [f"{GROUP}:server"]


def test_a_resumed_group_keeps_the_totals_of_its_finished_rtt_and_of_its_earlier_server(fake_processes):
    """The RTT whose worker ended in the earlier run is not run again, but its proxy totals and the
    earlier server's time are kept and added to this run's."""
    names = []

    def worker(job, env, prefix, name):
        names.append(name)
        return {"done": True}

    kept = Kept(finished={f"{GROUP}@0ms": {"rss_peak_bytes": 3, "seconds": 1.0}},
                totals={f"{GROUP}@0ms": [{"bytes_up": 40}], f"{GROUP}@30ms": [{"bytes_up": 2}],
                        f"{GROUP}:server": [{"rss_peak_bytes": 50, "seconds": 4.0}]})
    record, processes = _run_group(worker, kept=kept)
    assert names == [f"{GROUP}@30ms"]
    assert record.proxy_totals == {f"{GROUP}@0ms": {"bytes_up": 40}, f"{GROUP}@30ms": {"bytes_up": 32}}
    server = processes[f"{GROUP}:server"]
    assert server["rss_peak_bytes"] == 50 and server["workers"] == 2 and server["seconds"] >= 4.0


# ----------------------------------------------------------------------------- edge_worker.py


def _sse(events, status=200):
    def handler(request):
        return httpx.Response(status, headers={"content-type": "text/event-stream"}, content=iter(events))

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        return edge_worker.stream_completion(client, "http://cloud", {}, {"prompt": [1], "stream": True})


def _ticks(monkeypatch):
    ticks = iter(range(1000))
    monkeypatch.setattr(edge_worker, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))


def test_usage_is_kept_from_the_event_that_carried_it():
    """An event after the usage event (no usage of its own) does not erase the token count."""
    res = _sse([b'data: {"choices":[{"text":"Hi","finish_reason":"stop"}],"usage":{"completion_tokens":3}}\n\n',
                   b'data: {"choices":[]}\n\n', b"data: [DONE]\n\n"])
    assert res.tokens == 3 and res.text == "Hi"


def test_a_stream_with_no_text_has_its_first_token_time_at_the_finish(monkeypatch):
    """No event carried text: TTFT is the finish event's arrival (read 2), not the end of the stream (read 3)."""
    _ticks(monkeypatch)
    events = [b'data: {"choices":[{"text":"","finish_reason":"length"}],"usage":{"completion_tokens":0}}\n\n',
              b"data: [DONE]\n\n"]

    def handler(request):
        return httpx.Response(200, content=iter([events[0], b"", events[1]]))

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        res = edge_worker.stream_completion(client, "http://cloud", {}, {"stream": True})
    assert res.ttft_s == res.wall_s == 1.0


def test_an_error_event_stops_the_stream_with_the_servers_message():
    with pytest.raises(SpecdecError, match="the server stopped the stream: out of memory"):
        _sse([b'data: {"error":{"message":"out of memory"}}\n\n'])


def test_a_refused_streaming_request_says_the_status_and_why():
    """A 401 (wrong key) is refused at once, with the server's words, not read as an empty stream."""
    with pytest.raises(SpecdecError, match="streaming completion refused: HTTP 401: .*bad key"):
        _sse([b'{"error": "bad key"}'], status=401)


@pytest.mark.parametrize("early", [[httpx.ReadTimeout("slow")], [httpx.ConnectError("refused")] * 2],
                         ids=["timed-out", "refused"])
def test_waiting_for_the_server_survives_health_checks_that_fail_while_it_starts(monkeypatch, early):
    """A loading server may accept the connection and not answer in time, or, before it listens,
    refuse it (a ConnectError, not a timeout): keep polling either way."""
    answers = iter([*early, httpx.Response(200)])
    polls = []

    def handler(request):
        polls.append(request.url.path)
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    monkeypatch.setattr(edge_worker, "time", SimpleNamespace(monotonic=lambda: 0.0, sleep=lambda s: None))
    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        edge_worker.wait_ready(client, "http://cloud", timeout_s=10.0)
    assert polls == ["/health"] * (len(early) + 1)


def test_waiting_for_the_server_gives_up_at_the_timeout(monkeypatch):
    """Never ready: one poll at t=0 (before the deadline), one at t=1.5 (past the 1 s deadline), then the error."""
    clock = iter([0.0, 0.5, 1.5, 2.5, 3.5, 4.5])
    polls = []

    def handler(request):
        polls.append(1)
        return httpx.Response(503)

    monkeypatch.setattr(edge_worker, "time", SimpleNamespace(monotonic=lambda: next(clock), sleep=lambda s: None))
    with httpx.Client(transport=httpx.MockTransport(handler)) as client, \
            pytest.raises(SpecdecError, match="did not answer /health within 1 s"):
        edge_worker.wait_ready(client, "http://cloud", timeout_s=1.0)
    assert len(polls) == 2


def test_a_failing_health_check_is_not_timed_as_a_round_trip():
    with httpx.Client(transport=httpx.MockTransport(lambda request: httpx.Response(503))) as client, \
            pytest.raises(httpx.HTTPStatusError):
        edge_worker.ping_ms(client, "http://cloud")


ONE_EVENT = [b'data: {"choices":[{"text":"Hello","finish_reason":"length"}],"usage":{"completion_tokens":2}}\n\n',
          b"data: [DONE]\n\n"]


def test_the_streaming_baseline_sends_the_runs_sampling_settings():
    """Seed, temperature, token budget, top-p and repetition penalty go to the server as set."""
    from specdec.sampling import SamplingConfig

    bodies = []

    def handler(request):
        bodies.append(json.loads(request.read()))
        return httpx.Response(200, content=iter(ONE_EVENT))

    job = SimpleNamespace(draft="smollm2-135m-draft", api_key="k", url="http://cloud")
    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        _, generate = edge_worker._stream_runner(job, client, True)
        generate([1, 2], SamplingConfig(temperature=0.7, seed=9, max_new_tokens=5, top_p=0.9, repetition_penalty=1.2), None, None)
    [body] = bodies
    assert (body["seed"], body["temperature"], body["max_tokens"], body["top_p"], body["repetition_penalty"]) == (9, 0.7, 5, 0.9, 1.2)
    assert "gamma" not in body and body["stream"] is True and body["stream_options"] == {"include_usage": True}


def test_the_edge_runner_passes_q_top_k_on_and_times_from_the_first_to_the_last_tokens(monkeypatch):
    """edge_cloud rows: sparse-q's top-k and γ "auto" (when none is set) reach generate_remote; TTFT is
    the first batch of tokens (tick 1), wall time the last (tick 2), not the return (tick 3);
    tokens per call = tokens / verify calls; the network RTT = round time - server time per call."""
    import specdec.engine
    import specdec.remote.edge
    from specdec.sampling import SamplingConfig

    seen = {}
    draft = SimpleNamespace(tokenizer=None, eos_ids=[0])
    monkeypatch.setattr(specdec.engine, "load_draft", lambda cfg: draft)
    monkeypatch.setattr(specdec.engine, "model_drafter", lambda cfg, d, lookup: ("drafter", "name"))

    def generate_remote(ids, sampling, remote, **kw):
        seen.update(kw, wire=remote.wire)
        kw["on_tokens"]([5, 6])  # tick 1
        kw["on_tokens"]([])      # no tokens: no tick
        kw["on_tokens"]([7, 8])  # tick 2
        remote_totals = {"verify_calls": 2, "bytes_up": 1, "bytes_down": 1, "wire_bytes_up": 2, "wire_bytes_down": 2,
                         "rtt_ms": 50.0, "rtt_ms_p50": 50.0, "cloud_server_ms_total": 20.0, "cloud_prefill_ms": 1.0,
                         "session_prefill_ms": 1.0, "retries": 0, "session_recreates": 0, "unverified_tokens": 0, "method": "sparse-q"}
        stats = SimpleNamespace(draft_tokens_proposed=4, draft_tokens_accepted=2, acceptance_rate=0.5, mean_gamma=2.0,
                                draft_s=0.1, draft_temperature_factor=0.85, finish_reason="length")
        return SimpleNamespace(remote=remote_totals, stats=stats, token_ids=[5, 6, 7, 8], lossless=True, text="abcd")

    monkeypatch.setattr(specdec.remote.edge, "generate_remote", generate_remote)
    _ticks(monkeypatch)
    job = SimpleNamespace(draft="smollm2-135m-draft", draft_dtype="auto", draft_vocab="auto", draft_temperature_factor="auto",
                          url="http://cloud", api_key="k", q_top_k=8)
    _, generate = edge_worker._edge_runner(job, client=None)
    row = generate([1, 2], SamplingConfig(temperature=1.0, seed=1), "sparse-q", None)
    assert (seen["q_top_k"], seen["gamma"], seen["wire"]) == (8, "auto", "sparse-q")
    assert (row["ttft_s"], row["wall_s"], row["generated_tokens"]) == (1.0, 2.0, 4)
    assert row["tokens_per_call"] == 2.0 and row["net_rtt_ms"] == 40.0 and row["text_sha1"] == edge_worker.text_sha1("abcd")


def test_run_network_skips_finished_temperatures_warms_up_short_and_records_each_units_seed(monkeypatch):
    """A temperature with no units left is not run (not even its warm-up); the warm-up generations
    are WARMUP_TOKENS long and unrecorded; each row runs at its unit's seed and records the set RTT."""
    from specdec.sampling import SamplingConfig

    calls = []

    def runner(mode):
        def generate(ids, sampling, wire, gamma):
            calls.append((mode, sampling.temperature, sampling.seed, sampling.max_new_tokens))
            return {"generated_tokens": 1}
        return (lambda text, chat: [1]), generate

    monkeypatch.setattr(edge_worker, "wait_ready", lambda client, url: None)
    monkeypatch.setattr(edge_worker, "ping_ms", lambda client, url: 31.5)
    monkeypatch.setattr(edge_worker, "_edge_runner", lambda job, client: runner("edge_cloud"))
    monkeypatch.setattr(edge_worker, "_stream_runner", lambda job, client, plain: runner("cloud_streaming"))
    job = SimpleNamespace(url="http://cloud", net_modes=["cloud_streaming", "edge_cloud"], temperatures=[0.0, 1.0],
                          wires=["greedy", "sparse-q"], gammas=["auto"], rtt_ms=30.0, emulation="proxy")
    p = SimpleNamespace(id="p", text="x", chat=False, category="code")
    rows = []
    edge_worker.run_network(job, [p], rows.append,
                            sampling_for=lambda job, t, seed: SamplingConfig(temperature=t, seed=seed, max_new_tokens=100),
                            peak_rss=lambda: 1, todo=lambda job, prompts, t: [] if t == 0.0 else [p],
                            units=lambda job, prompts, t: iter([(0, 7, 0, p)]))
    w = edge_worker.WARMUP_TOKENS
    assert calls == [("cloud_streaming", 1.0, 0, w), ("edge_cloud", 1.0, 0, w),
                     ("cloud_streaming", 1.0, 7, 100), ("edge_cloud", 1.0, 7, 100)]
    assert [(r["mode"], r["method"], r["seed"], r["rtt_ms"], r["ping_ms"]) for r in rows] == [
        ("cloud_streaming", "cloud_streaming", 7, 30.0, 31.5), ("edge_cloud", "sparse-q", 7, 30.0, 31.5)]


def test_a_resumed_group_whose_rtts_all_ended_starts_no_server(fake_processes):
    """Every RTT's worker ended in the earlier run: no server (and no worker) starts; the server
    record is the earlier run's."""
    def worker(job, env, prefix, name):
        raise AssertionError("no worker may start")

    kept = Kept(finished={f"{GROUP}@0ms": {"seconds": 1.0}, f"{GROUP}@30ms": {"seconds": 1.0}},
                totals={f"{GROUP}:server": [{"rss_peak_bytes": 50, "seconds": 4.0}]})
    record, processes = _run_group(worker, kept=kept)
    assert fake_processes["servers"] == [] and processes[f"{GROUP}:server"] == {"rss_peak_bytes": 50, "seconds": 4.0}
    assert record.servers[GROUP] == {"draft": "none", "rss_peak_bytes": 50}


def _proxy_script(monkeypatch, script: str) -> None:
    """Link.start runs ``sh -c script`` instead of the delay proxy."""
    real = subprocess.Popen
    monkeypatch.setattr(network.subprocess, "Popen", lambda argv, **kw: real(["sh", "-c", script], **kw))


def test_a_proxy_that_writes_much_to_stderr_neither_blocks_nor_hides_its_totals(monkeypatch):
    """The proxy's stderr is not a pipe nobody reads while it runs: 200 kB of it (past a 64 KiB pipe)
    before its "listening" line, and the link still starts and stops with its totals. The 30 s join
    only guards against the hang; nothing here is timed."""
    import threading

    _proxy_script(monkeypatch, "head -c 200000 /dev/zero | tr '\\0' x >&2; "
                               "trap 'echo \"{\\\"stopped\\\": true, \\\"bytes_up\\\": 3}\"; exit 0' TERM; "
                               "echo '{\"listening\": 4321}'; while :; do sleep 0.05; done")
    link = network.Link(_server(PROXY), 20.0)
    started = threading.Thread(target=link.start, daemon=True)
    started.start()
    started.join(30)
    hung = started.is_alive()
    if hung:
        link.proc.kill()
    assert not hung, "the proxy blocked on a full stderr pipe"
    assert link.url == "http://127.0.0.1:4321"
    assert link.stop() == {"bytes_up": 3}


def test_a_proxy_that_did_not_start_says_what_it_wrote_to_stderr(monkeypatch):
    _proxy_script(monkeypatch, "echo 'delay proxy: cannot listen on 0: denied' >&2; exit 1")
    with pytest.raises(SpecdecError, match="the delay proxy did not start: delay proxy: cannot listen on 0: denied"):
        network.Link(_server(PROXY), 20.0).start()


def test_acceptance_does_not_need_the_cloud_calls():
    """Rows that record drafted and accepted tokens but no cloud calls still give the acceptance."""
    [g] = netreport.aggregate_network([_edge("a", 10.0, calls=None, prop=20, acc=15)])
    assert g.cloud_calls_per_token is None and g.acceptance == pytest.approx(0.75)


def test_groups_sort_by_wire_before_gamma():
    """Within a mode and temperature: the wire (method) first, then γ."""
    rows = [{**_edge("a", 10.0, wire="greedy"), "gamma": "4"}, {**_edge("a", 10.0, wire="coupled"), "gamma": "8"}]
    assert [(g.method, g.gamma) for g in netreport.aggregate_network(rows)] == [("coupled", "8"), ("greedy", "4")]


def test_a_row_without_an_emulation_record_has_none():
    """Older rows without "emulation" are not claimed to have used the proxy."""
    row = {k: v for k, v in _edge("a", 10.0).items() if k != "emulation"}
    assert netreport.aggregate_network([row])[0].emulation is None


def test_a_fractional_rtt_is_printed_as_configured():
    """RTT 12.5 ms prints as 12.5, not rounded to 12."""
    lines = netreport.markdown(netreport.aggregate_network([_edge("a", 10.0, rtt=12.5)]), None)
    assert any(line.startswith("| edge_cloud/greedy | auto | 0 | 12.5 |") for line in lines)


def test_an_unrecorded_emulation_is_not_described_as_netem():
    """A result that did not record its RTT emulation says "?" and is not described as tc netem."""
    text = "\n".join(netreport.markdown(netreport.aggregate_network(_samples()), None))
    assert "RTT emulation: **?**" in text and "tc netem" not in text


def test_saved_network_groups_carry_their_label(tmp_path):
    """results.json's network_groups hold each group's label (what the table and plots call it)."""
    cfg = {"target": "t", "draft": "d", "draft_dtype": "auto", "prompts": [{"category": "code"}], "max_new_tokens": 20,
           "repeats": 1, "seed": 0, "top_p": None, "repetition_penalty": None, "batch_invariant": True}
    rows = [_stream("a", 10.0), _edge("a", 20.0)]
    report.write({"config": cfg, "samples": rows, "processes": {}, "machine": {}}, tmp_path, make_plots=False)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert sorted(g["label"] for g in saved["network_groups"]) == ["cloud_streaming (plain server)", "edge_cloud/greedy"]


def test_same_text_skips_rows_that_recorded_no_text():
    """An edge row without a text digest is not a prompt that disagreed: it is not compared."""
    rows = [{**_stream(p, 10.0), "text_sha1": f"t{p}"} for p in "ab"]
    rows += [{**_edge("a", 20.0), "text_sha1": "ta"}, _edge("b", 20.0)]
    edge = {g.mode: g for g in netreport.aggregate_network(rows)}["edge_cloud"]
    assert (edge.same_text, edge.compared) == (1, 1)


def test_same_text_compares_with_a_baseline_that_generated_nothing():
    """A baseline at 0 tok/s (it stopped at once) has no speed-up to give, but its (empty) text is
    still what a lossless mode must reproduce: it is compared."""
    rows = [{**_stream("a", 10.0), "tokens_per_s": 0.0, "text_sha1": "empty"}, {**_edge("a", 20.0), "text_sha1": "empty"}]
    edge = {g.mode: g for g in netreport.aggregate_network(rows)}["edge_cloud"]
    assert edge.speedup_vs_streaming is None and (edge.same_text, edge.compared) == (1, 1)


def test_a_row_without_a_ping_is_left_out_of_the_median_ping():
    """Pings 10 and 30 ms and one row that measured none: the median is 20 (not the median of 0, 10, 30)."""
    rows = [_edge("a", 10.0, ping=10.0), _edge("b", 10.0, ping=30.0), {**_edge("c", 10.0), "ping_ms": None}]
    assert netreport.aggregate_network(rows)[0].ping_ms == pytest.approx(20.0)


def test_the_delay_proxy_is_given_the_full_rtt_and_forwards_to_the_servers_port(monkeypatch):
    """The proxy splits --rtt-ms itself (half each way): the link passes the configured RTT whole,
    points it at the server's port, and its URL is the port the proxy said it listens on."""
    real, seen = subprocess.Popen, []

    def popen(argv, **kw):
        seen.append(argv)
        return real(["sh", "-c", "echo '{\"listening\": 4321}'"], **kw)

    monkeypatch.setattr(network.subprocess, "Popen", popen)
    server = _server(PROXY)
    link = network.Link(server, 37.5).start()
    try:
        [argv] = seen
        assert argv[argv.index("--rtt-ms") + 1] == "37.5"
        assert argv[argv.index("--to") + 1] == f"127.0.0.1:{server.port}"
        assert link.url == "http://127.0.0.1:4321"
    finally:
        link.stop()


def test_under_netem_a_link_sets_the_full_rtt_with_the_script_and_starts_no_proxy(monkeypatch):
    runs = []
    monkeypatch.setattr(network.subprocess, "run", lambda argv, **kw: runs.append(argv))
    monkeypatch.setattr(network.subprocess, "Popen", lambda *a, **k: pytest.fail("no proxy under netem"))
    server = _server(NETEM)
    link = network.Link(server, 50.0).start()
    assert runs == [["bash", "/x/netem.sh", "set", "50"]]
    assert link.url == server.url and link.stop() == {}


def test_a_proxy_whose_first_line_is_json_without_its_port_did_not_start(monkeypatch):
    """A first stdout line that is JSON but names no port (not the "listening" line) is a
    SpecdecError that quotes it, not a KeyError."""
    real = subprocess.Popen
    monkeypatch.setattr(network.subprocess, "Popen",
                        lambda argv, **kw: real(["sh", "-c", "echo '{\"error\": \"bad --to\"}'; exit 2"], **kw))
    with pytest.raises(SpecdecError, match='the delay proxy did not start: {"error": "bad --to"}'):
        network.Link(_server(PROXY), 20.0).start()
