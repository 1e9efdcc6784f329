"""Aggregate and render the edge–cloud bench modes (pure functions of the samples; no timing).

One :class:`NetworkStats` per (mode, wire, γ, temperature, RTT).  Per-token figures are ratios
of sums over the group (total bytes / total generated tokens, total cloud calls / total tokens);
the speed-up is the median over prompts of the per-prompt tokens/s ratio against
``cloud_streaming`` with the same temperature, RTT, prompt and seed.  At temperature 0 every
lossless mode must produce the baseline's text; ``same_text`` counts the prompts where it did.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from specdec.bench.network import NETWORK_MODES

BASELINE = "cloud_streaming"


def gamma_order(gamma) -> tuple:
    """Sort key for γ labels: numbers in numeric order, then the policies ('auto', 'guide')."""
    text = str(gamma)
    return (0, int(text), "") if text.lstrip("-").isdigit() else (1, 0, text)


def is_network(sample: dict) -> bool:
    return sample.get("mode") in NETWORK_MODES


def _quantile(values: list[float], q: float) -> float:
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _median(values: list[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def net_key(s: dict) -> tuple:
    return (s["mode"], s["method"], s.get("gamma"), float(s["temperature"]), float(s["rtt_ms"]))


def pair_key(s: dict) -> tuple:
    return (float(s["temperature"]), float(s["rtt_ms"]), s["prompt_id"], s["seed"])


@dataclass
class NetworkStats:
    mode: str
    method: str  # the wire mode for edge_cloud, the mode's name otherwise
    gamma: str | None
    temperature: float
    rtt_ms: float  # as configured
    n: int
    lossless: bool
    emulation: str | None
    tokens_per_s_median: float
    tokens_per_s_q25: float
    tokens_per_s_q75: float
    ttft_median_s: float
    generated_tokens_mean: float
    speedup_vs_streaming: float | None = None
    cloud_calls_per_token: float | None = None
    tokens_per_call: float | None = None
    acceptance: float | None = None
    bytes_up_per_token: float | None = None  # JSON payload
    bytes_down_per_token: float | None = None
    wire_bytes_up_per_token: float | None = None  # + HTTP heads (and chunk framing for streams)
    wire_bytes_down_per_token: float | None = None
    ping_ms: float | None = None  # median GET /health round trip
    net_rtt_ms: float | None = None  # median per generation of (mean verify round − server time)
    round_ms: float | None = None  # median per generation of the mean verify round
    same_text: int | None = None  # T = 0, lossless: generations whose text equals the baseline's
    compared: int | None = None  # ... out of this many paired ones

    @property
    def label(self) -> str:
        if self.mode == "edge_cloud":
            return f"edge_cloud/{self.method}" + ("" if self.lossless else " (LOSSY)")
        if self.mode == "cloud_streaming_spec":
            return "cloud_streaming_spec (speculative server)"
        return f"{self.mode} (plain server)"


def _sum(rows: list[dict], key: str) -> float | None:
    vals = [r.get(key) for r in rows]
    return None if any(v is None for v in vals) else float(sum(vals))


def _group(mode: str, method: str, gamma: str | None, t: float, rtt: float, rows: list[dict]) -> NetworkStats:
    tps = [r["tokens_per_s"] for r in rows]
    tokens = sum(r["generated_tokens"] for r in rows)
    g = NetworkStats(
        mode=mode, method=method, gamma=gamma, temperature=t, rtt_ms=rtt, n=len(rows),
        lossless=all(r.get("lossless", True) for r in rows), emulation=rows[0].get("emulation"),
        tokens_per_s_median=statistics.median(tps), tokens_per_s_q25=_quantile(tps, 0.25), tokens_per_s_q75=_quantile(tps, 0.75),
        ttft_median_s=statistics.median(r["ttft_s"] for r in rows),
        generated_tokens_mean=statistics.fmean(r["generated_tokens"] for r in rows),
    )
    calls = _sum(rows, "cloud_calls")
    if calls is not None:
        g.cloud_calls_per_token = _ratio(calls, tokens)
        g.tokens_per_call = _ratio(tokens, calls)
    for attr, key in (("bytes_up_per_token", "bytes_up"), ("bytes_down_per_token", "bytes_down"),
                      ("wire_bytes_up_per_token", "wire_bytes_up"), ("wire_bytes_down_per_token", "wire_bytes_down")):
        total = _sum(rows, key)
        setattr(g, attr, _ratio(total, tokens) if total is not None else None)
    proposed = _sum(rows, "draft_tokens_proposed")
    if proposed:
        g.acceptance = _sum(rows, "draft_tokens_accepted") / proposed
    g.ping_ms = _median([r.get("ping_ms") for r in rows])
    g.net_rtt_ms = _median([r.get("net_rtt_ms") for r in rows])
    g.round_ms = _median([r.get("round_ms") for r in rows])
    return g


def aggregate_network(samples: list[dict]) -> list[NetworkStats]:
    """One :class:`NetworkStats` per (mode, method, γ, temperature, RTT), baseline speed-ups filled in."""
    rows = [s for s in samples if is_network(s)]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for s in rows:
        groups[net_key(s)].append(s)
    baseline = {pair_key(s): s for s in rows if s["mode"] == BASELINE}
    order = {m: i for i, m in enumerate(NETWORK_MODES)}
    out = []
    for key in sorted(groups, key=lambda k: (k[3], order[k[0]], k[1], gamma_order(k[2]), k[4])):
        g = _group(*key, groups[key])
        ratios = [s["tokens_per_s"] / baseline[pair_key(s)]["tokens_per_s"] for s in groups[key]
                  if pair_key(s) in baseline and baseline[pair_key(s)]["tokens_per_s"] > 0]
        g.speedup_vs_streaming = statistics.median(ratios) if ratios else None
        if g.temperature == 0.0 and g.lossless and g.mode != BASELINE:
            g.same_text, g.compared = same_text(groups[key], baseline)
        out.append(g)
    return out


def same_text(rows: list[dict], baseline: dict[tuple, dict]) -> tuple[int, int]:
    """(matching, compared): rows whose ``text_sha1`` equals the paired baseline row's."""
    pairs = [(r.get("text_sha1"), baseline[pair_key(r)].get("text_sha1")) for r in rows if pair_key(r) in baseline]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    return sum(a == b for a, b in pairs), len(pairs)


@dataclass(frozen=True)
class BytesPerToken:
    """Bytes per generated token of one mode/wire at one temperature, over every RTT."""

    label: str
    temperature: float
    payload_up: float | None
    payload_down: float | None
    wire_up: float | None
    wire_down: float | None


def bytes_by_wire(samples: list[dict]) -> list[BytesPerToken]:
    """Σ bytes / Σ tokens per (mode, method, temperature), pooled over RTTs and γ."""
    by: dict[tuple, list[dict]] = defaultdict(list)
    for s in samples:
        if is_network(s):
            by[(s["mode"], s["method"], float(s["temperature"]))].append(s)
    out = []
    for (mode, method, t), rows in sorted(by.items(), key=lambda kv: (kv[0][2], kv[0][0], kv[0][1])):
        tokens = sum(r["generated_tokens"] for r in rows)
        vals = {}
        for key in ("bytes_up", "bytes_down", "wire_bytes_up", "wire_bytes_down"):
            total = _sum(rows, key)
            vals[key] = _ratio(total, tokens) if total is not None else None
        label = f"{mode}/{method}" if mode == "edge_cloud" else mode
        out.append(BytesPerToken(label, t, vals["bytes_up"], vals["bytes_down"], vals["wire_bytes_up"], vals["wire_bytes_down"]))
    return out


# ----------------------------------------------------------------------------- rendering


def _f(x: float | None, nd: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def markdown(stats: list[NetworkStats], network: dict | None) -> list[str]:
    """The report's edge–cloud section (Markdown lines)."""
    if not stats:
        return []
    network = network or {}
    kind = network.get("rtt_emulation", "?")
    how = ("`tc netem` in two network namespaces (scripts/netem.sh)" if kind == "netem" else
           "the asyncio delay proxy (`python -m specdec.remote.delay_proxy`: RTT/2 each way, order kept, no bandwidth "
           "limit, TCP handshake not delayed)")
    lines = [
        "", "## Edge–cloud split (emulated RTT)", "",
        f"RTT emulation: **{kind}** — {how}. Check: {network.get('detail', '–')}.", "",
        "The cloud is `specdec serve` in its own process; the edge is another process (draft model and decoding "
        "loop for `edge_cloud`, a streaming HTTP client for the baselines). Tokens/s and TTFT are measured by the "
        "edge, from its first request (session creation / completion request) to the arrival of the last / first "
        "token. ×streaming = median per-prompt speed-up over `cloud_streaming` (plain decoding on the server) at "
        "the same RTT and temperature. Bytes per generated token: payload = JSON bodies (event-stream body for "
        "streaming); wire = payload + HTTP request/status lines and headers (+ chunk framing), session set-up "
        "included, TCP/IP headers excluded. RTT measured: median `GET /health` round trip (ping) and, for "
        "`edge_cloud`, the mean verify round minus the server's handling time (net). Cloud calls/token for plain "
        "streaming = 1 by construction (one target forward per token); the speculative server does not report its "
        "calls over the stream. `edge_cloud` and `cloud_streaming` share one server and run interleaved prompt by "
        "prompt; `cloud_streaming_spec` needs a server with a drafter and runs afterwards, so its ×streaming "
        "compares runs minutes apart. Same text: at T = 0, generations of a lossless mode whose text equals "
        "`cloud_streaming`'s for the same prompt.", "",
        "| mode | γ | T | RTT ms | measured ping / net ms | tok/s median [IQR] | ×streaming | TTFT ms | cloud calls/token "
        "| tokens/call | acceptance | B up/token payload (wire) | B down/token payload (wire) | same text |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in stats:
        lines.append(
            f"| {g.label} | {g.gamma or '–'} | {g.temperature:g} | {g.rtt_ms:g} | {_f(g.ping_ms, 1)} / {_f(g.net_rtt_ms, 1)} "
            f"| {g.tokens_per_s_median:.1f} [{g.tokens_per_s_q25:.1f}–{g.tokens_per_s_q75:.1f}] | {_f(g.speedup_vs_streaming)} "
            f"| {1e3 * g.ttft_median_s:.0f} | {_f(g.cloud_calls_per_token, 3)} | {_f(g.tokens_per_call)} | {_f(g.acceptance)} "
            f"| {_f(g.bytes_up_per_token, 1)} ({_f(g.wire_bytes_up_per_token, 1)}) "
            f"| {_f(g.bytes_down_per_token, 1)} ({_f(g.wire_bytes_down_per_token, 1)}) "
            f"| {'–' if not g.compared else f'{g.same_text}/{g.compared}'} |"
        )
    totals = network.get("proxy_totals") or {}
    if totals:
        lines += ["", "Bytes forwarded by the delay proxy (all traffic of that edge process: warm-ups, pings, session "
                  "deletes included):", "", "| process | connections | bytes up | bytes down |", "|---|---|---|---|"]
        for name, t in totals.items():
            lines.append(f"| {name} | {t.get('connections', '–')} | {t.get('bytes_up', '–')} | {t.get('bytes_down', '–')} |")
    servers = network.get("servers") or {}
    if servers:
        lines += ["", "| server for mode | server drafter | peak RSS MiB |", "|---|---|---|"]
        for mode, s in servers.items():
            rss = s.get("rss_peak_bytes")
            lines.append(f"| {mode} | {s.get('draft')} | {rss / 2**20:.0f} |" if rss else f"| {mode} | {s.get('draft')} | – |")
    return lines


def plot(stats: list[NetworkStats], per_wire: list[BytesPerToken], out_dir: Path, save) -> list[str]:  # noqa: ANN001
    """Tokens/s vs RTT per mode/wire (one panel per temperature) and bytes per token per wire; returns paths."""
    if not stats:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    temps = sorted({g.temperature for g in stats})
    fig, axes = plt.subplots(1, len(temps), figsize=(5.5 * len(temps), 4), squeeze=False)
    for ax, t in zip(axes[0], temps):
        series: dict[str, list[NetworkStats]] = defaultdict(list)
        for g in stats:
            if g.temperature == t:
                series[g.label + ("" if g.gamma in (None, "auto") else f" γ={g.gamma}")].append(g)
        for name, rows in series.items():
            rows.sort(key=lambda g: g.rtt_ms)
            ax.plot([g.rtt_ms for g in rows], [g.tokens_per_s_median for g in rows], marker="o",
                    ls="--" if "cloud_streaming" in name else "-", label=name)
        ax.set(title=f"T = {t:g}", xlabel="emulated RTT (ms)", ylabel="tokens/s (median)", ylim=(0, None))
        ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(save(fig, out_dir / "edge_cloud_tokens_per_s_vs_rtt.png"))

    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(per_wire)), 4))
    xs = range(len(per_wire))
    bars = (("payload_up", "payload up"), ("wire_up", "wire up"), ("payload_down", "payload down"), ("wire_down", "wire down"))
    for i, (attr, name) in enumerate(bars):
        ax.bar([x + (i - 1.5) * 0.2 for x in xs], [getattr(b, attr) or 0 for b in per_wire], 0.2, label=name)
    ax.set_xticks(list(xs), [f"{b.label}\nT={b.temperature:g}" for b in per_wire], fontsize=7, rotation=20, ha="right")
    ax.set(ylabel="bytes per generated token", title="bytes per token (all RTTs pooled)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(save(fig, out_dir / "edge_cloud_bytes_per_token.png"))
    return paths
