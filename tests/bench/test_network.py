"""The edge-cloud bench modes: planning, RTT-emulation detection and the metrics (synthetic samples, no timing)."""

from __future__ import annotations

import json

import pytest

from specdec.bench import netreport, network, report
from specdec.bench.edge_worker import chunked_wire_bytes, interleaved_settings
from specdec.errors import SpecdecError

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
