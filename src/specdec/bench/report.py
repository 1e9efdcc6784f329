"""Aggregate benchmark samples into metrics, theory, a Markdown report and PNG plots.

Every function here is a pure function of the samples (no timing), so the tests can check the
metric computations on synthetic data.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdec.bench import netreport, theory
from specdec.outputs import write_text

#: plain decoding with the coupled rule (seeded Gumbel-max sampling) in the speculative worker: the
#: reference of the coupled rows at T > 0, whose tokens must equal it
PAIRED_COUPLED = "plain_paired_coupled"
PLAIN_MODES = ("plain", "plain_paired", PAIRED_COUPLED)
ENGINE_MODES = (*PLAIN_MODES, "edge_only", "speculative")
LLAMACPP_PLAIN = "llamacpp_plain"


def _quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default), q in [0, 1]."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean_se(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    m = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return m, se


def group_key(s: dict) -> tuple:
    """(mode, method, γ, T, drafter); the drafter is None unless the run compared several."""
    return (s["mode"], s["method"], s.get("gamma"), float(s["temperature"]), s.get("draft"))


def pair_key(s: dict) -> tuple:
    return (float(s["temperature"]), s["prompt_id"], s["seed"])


def runs_by_pair(samples: list[dict], modes: tuple[str, ...] = PLAIN_MODES) -> dict[str, dict[tuple, dict]]:
    """Each of ``modes``' runs by :func:`pair_key` (a mode the results lack maps to ``{}``)."""
    out: dict[str, dict[tuple, dict]] = {mode: {} for mode in modes}
    for s in samples:
        if s["mode"] in out:
            out[s["mode"]][pair_key(s)] = s
    return out


def plain_reference(mode: str, method: str, refs: dict[str, dict[tuple, dict]]) -> str:
    """The plain mode a group's "×plain" is taken against, given the run's plain runs ``refs``
    (:func:`runs_by_pair`): speculative rows use the plain run taken in the same process seconds
    apart (plain_paired), and coupled ones the plain run that draws as they do
    (plain_paired_coupled) where the bench made one; everything else, and results written before
    either existed, use plain."""
    if mode != "speculative":
        return "plain"
    if method == "coupled" and refs.get(PAIRED_COUPLED):
        return PAIRED_COUPLED
    return "plain_paired" if refs.get("plain_paired") else "plain"


@dataclass
class GroupStats:
    mode: str
    method: str
    gamma: str | None
    temperature: float
    n: int
    lossless: bool
    tokens_per_s_median: float
    tokens_per_s_q25: float
    tokens_per_s_q75: float
    latency_p50_s: float
    latency_p95_s: float
    ttft_median_s: float
    generated_tokens_mean: float
    speedup_vs_cloud: float | None = None  # median over prompts of the per-prompt ratio
    #: the same ratio of decode tokens/s (the prompt's forward pass left out of both runs), where
    #: the rows record it: what the theory's ideal, a decoding loop without its prompt, compares with
    speedup_decode: float | None = None
    speedup_vs_hf_assisted: float | None = None
    speedup_vs_hf_plain: float | None = None
    speedup_vs_llamacpp: float | None = None  # against llama.cpp plain decoding of the same GGUF
    decode_tokens_per_s_median: float | None = None  # generated / (wall - prompt forward pass)
    same_tokens_as_llamacpp: tuple[int, int] | None = None  # (equal, compared) greedy outputs vs llama.cpp plain
    speedup_by_category: dict[str, float] = field(default_factory=dict)
    tokens_per_s_by_category: dict[str, float] = field(default_factory=dict)
    tokens_per_call: float | None = None
    tokens_per_call_se: float | None = None
    acceptance: float | None = None
    acceptance_per_position: list[float] = field(default_factory=list)
    mean_gamma: float | None = None
    draft_share: float | None = None
    target_share: float | None = None
    verify_share: float | None = None
    cloud_calls_per_token: float | None = None
    draft_step_ms: float | None = None
    verify_ms: float | None = None
    kv_peak_bytes: int | None = None
    rss_peak_bytes: int | None = None
    kv_share_of_rss: float | None = None
    # theory (speculative groups only)
    alpha_iid: float | None = None
    cost_ratio_c: float | None = None
    predicted_speedup_iid: float | None = None
    optimal_gamma_iid: int | None = None
    ideal_speedup: float | None = None
    efficiency: float | None = None  # measured speed-up / ideal speed-up
    overhead_share: float | None = None
    #: rounds by accepted draft tokens, summed over the group's runs (chain vs token trees)
    accepted_histogram: list[int] = field(default_factory=list)
    #: the drafter, when one run compared several (``specdec bench --draft A,B``)
    draft: str | None = None

    @property
    def what(self) -> str:
        """The method, and the drafter when the run compared several."""
        return self.method + (f" · {self.draft}" if self.draft else "")


def _draft_order(samples: list[dict]) -> dict[str | None, int]:
    """Drafters in the order the run listed them (None: a run of one drafter)."""
    order: dict[str | None, int] = {}
    for s in samples:
        order.setdefault(s.get("draft"), len(order))
    return order


def _ratios(samples: list[dict], reference: dict[tuple, dict]) -> list[tuple[str, float]]:
    out = []
    for s in samples:
        ref = reference.get(pair_key(s))
        if ref and ref["tokens_per_s"] > 0:
            out.append((s["category"], s["tokens_per_s"] / ref["tokens_per_s"]))
    return out


def _decode_ratio(samples: list[dict], reference: dict[tuple, dict]) -> float | None:
    """Median over prompts of decode tok/s against the reference's (:func:`_decode_tps`); None
    unless every sample and its reference record their prompt's forward pass."""
    out = []
    for s in samples:
        ref = reference.get(pair_key(s))
        a, b = _decode_tps(s), (_decode_tps(ref) if ref else None)
        if a is None or not b:
            return None
        out.append(a / b)
    return statistics.median(out) if out else None


#: mode names of older results.json files -> today's
_OLD_MODES = {"cloud_only": "plain"}


def upgrade(samples: list[dict]) -> list[dict]:
    """Samples with old mode names renamed (results written before plain decoding was called "plain")."""
    out = []
    for s in samples:
        if s.get("mode") in _OLD_MODES:
            s = {**s, "mode": _OLD_MODES[s["mode"]], "method": _OLD_MODES.get(s.get("method"), s.get("method"))}
        out.append(s)
    return out


def aggregate(samples: list[dict], processes: dict | None = None) -> list[GroupStats]:
    """One :class:`GroupStats` per (mode, method, γ, temperature) of the local modes
    (the network modes are aggregated by :func:`specdec.bench.netreport.aggregate_network`)."""
    processes = processes or {}
    samples = [s for s in upgrade(samples) if not netreport.is_network(s)]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for s in samples:
        groups[group_key(s)].append(s)
    refs = runs_by_pair(samples, (*PLAIN_MODES, "hf_assisted", "hf_plain", LLAMACPP_PLAIN))
    cloud_step: dict[tuple[str, float], float] = {}  # seconds per target call of plain decoding
    for (mode, _, _, t, _), rows in groups.items():
        if mode in PLAIN_MODES:
            calls = sum(r["target_calls"] for r in rows)
            cloud_step[(mode, t)] = sum(r["target_s"] for r in rows) / calls if calls else math.nan
    out = []
    order = _draft_order(samples)
    for (mode, method, gamma, t, draft), rows in sorted(groups.items(), key=lambda kv: (kv[0][0], order[kv[0][4]], kv[0][1], netreport.gamma_order(kv[0][2]), kv[0][3])):
        plain_ref = plain_reference(mode, method, refs)
        tps = [r["tokens_per_s"] for r in rows]
        walls = [r["wall_s"] for r in rows]
        g = GroupStats(
            mode=mode, method=method, gamma=gamma, temperature=t, n=len(rows), draft=draft,
            lossless=all(r.get("lossless", True) for r in rows),
            tokens_per_s_median=statistics.median(tps), tokens_per_s_q25=_quantile(tps, 0.25),
            tokens_per_s_q75=_quantile(tps, 0.75), latency_p50_s=_quantile(walls, 0.5),
            latency_p95_s=_quantile(walls, 0.95), ttft_median_s=statistics.median(r["ttft_s"] for r in rows),
            generated_tokens_mean=statistics.fmean(r["generated_tokens"] for r in rows),
        )
        cats = sorted({r["category"] for r in rows})
        g.tokens_per_s_by_category = {c: statistics.median(r["tokens_per_s"] for r in rows if r["category"] == c) for c in cats}
        decode = [_decode_tps(r) for r in rows]
        if all(d is not None for d in decode):
            g.decode_tokens_per_s_median = statistics.median(decode)
        for attr, ref_mode in (("speedup_vs_cloud", plain_ref), ("speedup_vs_hf_assisted", "hf_assisted"),
                               ("speedup_vs_hf_plain", "hf_plain"), ("speedup_vs_llamacpp", LLAMACPP_PLAIN)):
            ratios = _ratios(rows, refs[ref_mode])
            if ratios:
                setattr(g, attr, statistics.median(r for _, r in ratios))
                if attr == "speedup_vs_cloud":
                    g.speedup_decode = _decode_ratio(rows, refs[ref_mode])
                    g.speedup_by_category = {c: statistics.median(r for cc, r in ratios if cc == c) for c in cats if any(cc == c for cc, _ in ratios)}
        g.rss_peak_bytes = (processes.get(mode) or {}).get("rss_peak_bytes") or max((r.get("rss_peak_bytes") or 0) for r in rows) or None
        if mode in ENGINE_MODES:
            _engine_metrics(g, rows, cloud_step.get((plain_ref, t)))
        elif mode.startswith("llamacpp_"):
            _llamacpp_metrics(g, rows)
        _same_tokens(g, rows, refs[LLAMACPP_PLAIN])
        out.append(g)
    return out


def _decode_tps(row: dict) -> float | None:
    """Tokens/s with the prompt's forward pass left out (``prefill_s``; None if not recorded)."""
    prefill = row.get("prefill_s")
    if prefill is None or row["wall_s"] <= prefill:
        return None
    return row["generated_tokens"] / (row["wall_s"] - prefill)


def _llamacpp_metrics(g: GroupStats, rows: list[dict]) -> None:
    g.tokens_per_call, g.tokens_per_call_se = _mean_se([r["tokens_per_target_call"] for r in rows])
    proposed = sum(r.get("draft_tokens_proposed", 0) for r in rows)
    if proposed:
        g.acceptance = sum(r["draft_tokens_accepted"] for r in rows) / proposed
        g.mean_gamma = proposed / max(1, sum(r.get("draft_calls", 0) for r in rows))


def _same_tokens(g: GroupStats, rows: list[dict], plain: dict[tuple, dict]) -> None:
    """Greedy rows: on how many prompts the tokens equal llama.cpp plain decoding's."""
    pairs = [(r, plain.get(pair_key(r))) for r in rows if float(r["temperature"]) == 0 and r.get("tokens_sha1")]
    pairs = [(r, ref) for r, ref in pairs if ref is not None and ref.get("tokens_sha1")]
    if pairs and g.mode != LLAMACPP_PLAIN:
        g.same_tokens_as_llamacpp = (sum(r["tokens_sha1"] == ref["tokens_sha1"] for r, ref in pairs), len(pairs))


def _acceptance_per_position(rows: list[dict]) -> list[float]:
    """P(accepted ≥ k | drafted ≥ k) over ``rows``, each row weighted by what it drafted at k."""
    longest = max((len(r.get("proposed_per_position") or []) for r in rows), default=0)
    acc_k, prop_k = [0.0] * longest, [0] * longest
    for r in rows:
        for k, (rate, n) in enumerate(zip(r.get("acceptance_per_position") or [], r.get("proposed_per_position") or [])):
            acc_k[k] += rate * n
            prop_k[k] += n
    return [a / p if p else math.nan for a, p in zip(acc_k, prop_k)]


@dataclass(frozen=True)
class DrafterCategory:
    """One drafter's speculative rows at one temperature on one prompt category."""

    draft: str
    method: str
    gamma: str | None
    temperature: float
    category: str
    n: int
    tokens_per_call: float
    acceptance_per_position: list[float]
    draft_step_ms: float | None
    tokens_per_s_median: float
    speedup: float | None  # median per-prompt ratio to the paired plain run


def drafters_by_category(samples: list[dict]) -> list[DrafterCategory]:
    """The drafter × T × category table of a run that compared several drafters (``--draft A,B``)."""
    samples = upgrade(samples)
    refs = runs_by_pair(samples)
    groups: dict[tuple, list[dict]] = defaultdict(list)
    order = _draft_order(samples)
    for s in samples:
        if s["mode"] == "speculative" and s.get("draft"):
            groups[(s["draft"], s["method"], s.get("gamma"), float(s["temperature"]), s["category"])].append(s)
    out = []
    for (draft, method, gamma, t, cat), rows in sorted(groups.items(), key=lambda kv: (kv[0][3], order[kv[0][0]], kv[0][1], netreport.gamma_order(kv[0][2]), kv[0][4])):
        calls = sum(r["target_calls"] for r in rows)
        proposed = sum(r["draft_tokens_proposed"] for r in rows)
        ratios = [r for _, r in _ratios(rows, refs[plain_reference("speculative", method, refs)])]
        out.append(DrafterCategory(
            draft=draft, method=method, gamma=gamma, temperature=t, category=cat, n=len(rows),
            tokens_per_call=sum(r["generated_tokens"] for r in rows) / calls if calls else math.nan,
            acceptance_per_position=_acceptance_per_position(rows),
            draft_step_ms=1e3 * sum(r["draft_s"] for r in rows) / proposed if proposed else None,
            tokens_per_s_median=statistics.median(r["tokens_per_s"] for r in rows),
            speedup=statistics.median(ratios) if ratios else None,
        ))
    return out


def _engine_metrics(g: GroupStats, rows: list[dict], cloud_step_s: float | None) -> None:
    calls = sum(r["target_calls"] for r in rows)
    generated = sum(r["generated_tokens"] for r in rows)
    proposed = sum(r["draft_tokens_proposed"] for r in rows)
    accepted = sum(r["draft_tokens_accepted"] for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    g.tokens_per_call, g.tokens_per_call_se = _mean_se([r["tokens_per_target_call"] for r in rows])
    g.acceptance = accepted / proposed if proposed else None
    g.acceptance_per_position = _acceptance_per_position(rows)
    g.mean_gamma = proposed / calls if calls else 0.0
    hist: list[int] = []
    for r in rows:
        for k, count in enumerate(r.get("accepted_histogram") or []):
            hist += [0] * (k + 1 - len(hist))
            hist[k] += count
    g.accepted_histogram = hist
    g.draft_share = sum(r["draft_s"] for r in rows) / wall if wall else None
    g.target_share = sum(r["target_s"] for r in rows) / wall if wall else None
    g.verify_share = sum(r["verify_s"] for r in rows) / wall if wall else None
    g.cloud_calls_per_token = calls / generated if generated else None
    g.draft_step_ms = 1e3 * sum(r["draft_s"] for r in rows) / proposed if proposed else None
    g.verify_ms = 1e3 * sum(r["target_s"] for r in rows) / calls if calls else None
    g.kv_peak_bytes = max(r.get("kv_peak_bytes", 0) for r in rows)
    if g.rss_peak_bytes:
        g.kv_share_of_rss = g.kv_peak_bytes / g.rss_peak_bytes
    if g.mode != "speculative" or not proposed or not cloud_step_s or not g.draft_step_ms:
        return
    gamma = g.mean_gamma
    tpc = generated / calls
    g.cost_ratio_c = (g.draft_step_ms / 1e3) / cloud_step_s
    gi = max(1, round(gamma))
    g.alpha_iid = theory.alpha_from_block_efficiency(tpc, gi)
    g.predicted_speedup_iid = theory.speedup(g.alpha_iid, gi, g.cost_ratio_c)
    g.optimal_gamma_iid = theory.optimal_gamma(g.alpha_iid, g.cost_ratio_c)
    ideal_tps = theory.ideal_tokens_per_s(tpc, gamma, g.draft_step_ms / 1e3, g.verify_ms / 1e3)
    g.ideal_speedup = ideal_tps * cloud_step_s
    measured = g.speedup_decode or g.speedup_vs_cloud  # the ideal has no prompt pass: leave it out here too
    if measured:
        g.efficiency = measured / g.ideal_speedup
        g.overhead_share = 1.0 - g.efficiency


@dataclass(frozen=True)
class BlockVsToken:
    temperature: float
    gamma: str | None
    n_pairs: int
    token_tpc: float
    token_se: float
    block_tpc: float
    block_se: float
    ratio: float
    diff: float
    diff_se: float  # SE of the mean paired difference (same prompt and seed)


def block_vs_token(samples: list[dict]) -> list[BlockVsToken]:
    by = defaultdict(dict)
    for s in samples:
        if s["mode"] == "speculative" and s["method"] in ("token", "block") and s.get("draft") is None:
            by[(float(s["temperature"]), s.get("gamma"))].setdefault(s["method"], {})[(s["prompt_id"], s["seed"])] = s
    out = []
    for (t, gamma), methods in sorted(by.items(), key=lambda kv: (kv[0][0], netreport.gamma_order(kv[0][1]))):
        if "token" not in methods or "block" not in methods:
            continue
        keys = sorted(set(methods["token"]) & set(methods["block"]))
        if not keys:
            continue
        tok = [methods["token"][k]["tokens_per_target_call"] for k in keys]
        blk = [methods["block"][k]["tokens_per_target_call"] for k in keys]
        tm, ts = _mean_se(tok)
        bm, bs = _mean_se(blk)
        dm, ds = _mean_se([b - a for a, b in zip(tok, blk)])
        out.append(BlockVsToken(t, gamma, len(keys), tm, ts, bm, bs, bm / tm if tm else math.nan, dm, ds))
    return out


# ----------------------------------------------------------------------------- rendering


def greedy_identity(samples: list[dict]) -> list[tuple[str, int, int]]:
    """At T = 0, for each row kind: (label, prompts whose generated ids equal the plain run's
    of the same prompt, prompts compared).  The reference is plain decoding in the same process
    (plain_paired), else plain.  Rows without a digest (older results) are skipped."""
    ref: dict[tuple, str] = {}
    for name in ("plain", "plain_paired"):  # plain_paired wins where both exist
        for s in samples:
            if s.get("mode") == name and s.get("temperature") == 0 and s.get("tokens_sha1"):
                ref[(s["prompt_id"], s.get("seed"))] = s["tokens_sha1"]
    counts: dict[str, list[int]] = {}
    for s in samples:
        if s.get("temperature") != 0 or not s.get("tokens_sha1") or s.get("mode") in PLAIN_MODES:
            continue
        key = (s["prompt_id"], s.get("seed"))
        if key not in ref:
            continue
        label = f"{s.get('mode')} {s.get('method')}" + (f" · {s['draft']}" if s.get("draft") else "") + f" γ={s.get('gamma') or '–'}"
        c = counts.setdefault(label, [0, 0])
        c[0] += s["tokens_sha1"] == ref[key]
        c[1] += 1
    return [(label, same, n) for label, (same, n) in sorted(counts.items())]


def seeded_identity(samples: list[dict]) -> list[tuple[str, float, int, int]]:
    """At T > 0, for each coupled row kind: (label, T, prompts whose generated ids equal plain seeded
    sampling's of the same prompt and seed (plain_paired_coupled), prompts compared).  Coupled
    verification promises exactly that whatever the drafter, γ or tree."""
    ref = {pair_key(s): s["tokens_sha1"] for s in samples if s.get("mode") == PAIRED_COUPLED and s.get("tokens_sha1")}
    counts: dict[tuple[str, float], list[int]] = {}
    for s in samples:
        if s.get("mode") != "speculative" or s.get("method") != "coupled" or pair_key(s) not in ref or not s.get("tokens_sha1"):
            continue
        label = "speculative coupled" + (f" · {s['draft']}" if s.get("draft") else "") + f" γ={s.get('gamma') or '–'}"
        c = counts.setdefault((label, float(s["temperature"])), [0, 0])
        c[0] += s["tokens_sha1"] == ref[pair_key(s)]
        c[1] += 1
    return [(label, t, same, n) for (label, t), (same, n) in sorted(counts.items(), key=lambda kv: (kv[0][1], kv[0][0]))]


def _fmt(x, nd: int = 2, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if pct:
        return f"{round(100 * x) + 0:.0f}%"  # + 0: no "-0%" for a value that rounds to zero
    return f"{x:.{nd}f}"


def _mib(x) -> str:
    return "–" if not x else f"{x / 2**20:.0f}"


def _label(g: GroupStats) -> str:
    if g.mode == "speculative":
        return f"speculative/{g.what}" + ("" if g.lossless else " (LOSSY)")
    return g.mode


def markdown(result: dict, stats: list[GroupStats], bvt: list[BlockVsToken], plots: list[str],
             net: list[netreport.NetworkStats] | None = None) -> str:
    cfg = result["config"]
    lines = [
        "# specdec bench",
        "",
        f"Command: `{cfg.get('command') or 'specdec bench'}`",
        "",
        f"Target `{cfg['target']}` ({_target_dtype(cfg)}), draft `{cfg['draft']}` (draft dtype {_draft_dtype(cfg)}{_draft_vocab(cfg)}"
        f"{_draft_temperature(result.get('samples', []))}), "
        f"{len(cfg['prompts'])} prompts ({', '.join(sorted({p['category'] for p in cfg['prompts']}))}), "
        f"{cfg['max_new_tokens']} new tokens, repeats {cfg['repeats']}, seed {cfg['seed']}, "
        f"top-p {cfg['top_p']}, repetition penalty {cfg['repetition_penalty']}, "
        f"batch-invariant target {cfg['batch_invariant']}{_kv_dtype(cfg)}{_tree_floor(cfg)}.",
        "",
        f"Machine: {machine_line(result.get('machine', {}))}.",
        "",
        *_resumed(result.get("resumed"), cfg),
        "Speed-ups are medians over prompts of the per-prompt ratio against the same prompt and seed "
        "in the reference mode; for the speculative rows, \"×plain\" uses plain_paired: plain "
        "decoding of the same prompt in the same process, seconds apart (plain runs in its own "
        "process, minutes apart, and this shared machine drifts by 10-20% over minutes); a prompt's plain "
        "references and its speculative settings and drafters run in an order rotated from prompt to prompt and "
        "from repeat to repeat; coupled rows at T > 0 use "
        "plain_paired_coupled instead, plain seeded sampling (Gumbel-max, as coupled verification draws) of the "
        "same prompt and seed. "
        "Tokens/s = generated tokens / decoding wall time (prefill included, model loading excluded).",
    ]
    if stats:
        lines += _local_tables(stats, bvt)
        lines += _drafter_table(drafters_by_category(result.get("samples", [])))
        lines += _llamacpp_table(stats)
    ident = greedy_identity(result.get("samples", []))
    if ident:
        lines += ["", "## Greedy output identical to plain decoding (T = 0, generated ids, same prompt)", "",
                  "| row | identical | prompts |", "|---|---|---|"]
        lines += [f"| {label} | {same} | {n} |" for label, same, n in ident]
    seeded = seeded_identity(result.get("samples", []))
    if seeded:
        lines += ["", "## Seeded output identical to plain seeded sampling (coupled rule, T > 0, same prompt and seed)", "",
                  "| row | T | identical | prompts |", "|---|---|---|---|"]
        lines += [f"| {label} | {t:g} | {same} | {n} |" for label, t, same, n in seeded]
    lines += netreport.markdown(net or [], result.get("network"))
    procs = result.get("processes") or {}
    if procs:
        lines += ["", "## Processes (one per mode)", "", "| mode | peak RSS MiB | seconds |", "|---|---|---|"]
        for mode, p in procs.items():
            workers = f" ({p['workers']} processes)" if p.get("workers", 1) > 1 else ""
            lines.append(f"| {mode}{workers} | {_mib(p.get('rss_peak_bytes'))} | {p.get('seconds', 0):.0f} |")
    if plots:
        lines += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines) + "\n"


def _local_tables(stats: list[GroupStats], bvt: list[BlockVsToken]) -> list[str]:
    """Summary, per-category, theory, acceptance and block-vs-token tables of the local modes."""
    lines = [
        "",
        "## Summary",
        "",
        "Tokens/call ± SE: the mean over prompts of each prompt's generated tokens / target calls, and its standard "
        "error across prompts (the theory and drafter tables below pool them: all generated tokens / all target calls).",
        "",
        "| mode | γ | T | tok/s median [IQR] | ×plain | ×HF assisted | ×HF plain | tokens/call ± SE | acceptance | mean γ | TTFT ms | p50 / p95 s | draft / target share | cloud calls/token | RSS MiB | KV MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in stats:
        lines.append(
            f"| {_label(g)} | {g.gamma or '–'} | {g.temperature:g} | {g.tokens_per_s_median:.1f} [{g.tokens_per_s_q25:.1f}–{g.tokens_per_s_q75:.1f}] "
            f"| {_fmt(g.speedup_vs_cloud)} | {_fmt(g.speedup_vs_hf_assisted)} | {_fmt(g.speedup_vs_hf_plain)} "
            f"| {_fmt(g.tokens_per_call)} ± {_fmt(g.tokens_per_call_se, 3)} | {_fmt(g.acceptance)} | {_fmt(g.mean_gamma, 1)} "
            f"| {1e3 * g.ttft_median_s:.0f} | {g.latency_p50_s:.2f} / {g.latency_p95_s:.2f} "
            f"| {_fmt(g.draft_share, pct=True)} / {_fmt(g.target_share, pct=True)} | {_fmt(g.cloud_calls_per_token)} "
            f"| {_mib(g.rss_peak_bytes)} | {_fmt((g.kv_peak_bytes or 0) / 2**20, 1)} |"
        )
    cats = sorted({c for g in stats for c in g.tokens_per_s_by_category})
    lines += ["", "## By prompt category (median tok/s; speed-up over plain)", "",
              "| mode | γ | T | " + " | ".join(f"{c} tok/s | {c} ×plain" for c in cats) + " |",
              "|---|---|---|" + "---|---|" * len(cats)]
    for g in stats:
        cells = " | ".join(f"{_fmt(g.tokens_per_s_by_category.get(c), 1)} | {_fmt(g.speedup_by_category.get(c))}" for c in cats)
        lines.append(f"| {_label(g)} | {g.gamma or '–'} | {g.temperature:g} | {cells} |")
    spec = [g for g in stats if g.mode == "speculative"]
    if spec:
        lines += ["", "## Theory vs measurement", "",
                  "α (i.i.d. fit to the pooled tokens/call), c = draft step / plain target step; predicted = Leviathan et al. "
                  "E/(γc+1); ideal = this run's tokens/round over (mean γ · draft step + verify time), relative to "
                  "plain decoding's target step; measured × counts the prompt's forward pass (as tok/s above), "
                  "decode × leaves it out of both runs, as the ideal does; efficiency = decode × / ideal "
                  "(measured × / ideal where the rows do not record the prompt's pass).", "",
                  "| method | γ | T | α | c | draft step ms | verify ms | predicted ×(iid) | optimal γ (iid) | ideal × | measured × | decode × | efficiency | overhead share |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for g in spec:
            lines.append(
                f"| {g.what} | {g.gamma} | {g.temperature:g} | {_fmt(g.alpha_iid)} | {_fmt(g.cost_ratio_c, 3)} | {_fmt(g.draft_step_ms)} "
                f"| {_fmt(g.verify_ms)} | {_fmt(g.predicted_speedup_iid)} | {g.optimal_gamma_iid if g.optimal_gamma_iid is not None else '–'} "
                f"| {_fmt(g.ideal_speedup)} | {_fmt(g.speedup_vs_cloud)} | {_fmt(g.speedup_decode)} "
                f"| {_fmt(g.efficiency, pct=True)} | {_fmt(g.overhead_share, pct=True)} |"
            )
        lines += ["", "## Acceptance per draft position (P(accepted ≥ k | drafted ≥ k))", "",
                  "| method | γ | T | " + " | ".join(f"k={k}" for k in range(1, 13)) + " |",
                  "|---|---|---|" + "---|" * 12]
        for g in spec:
            cells = " | ".join(_fmt(a) for a in (g.acceptance_per_position + [math.nan] * 12)[:12])
            lines.append(f"| {g.what} | {g.gamma} | {g.temperature:g} | {cells} |")
    hists = [g for g in spec if g.accepted_histogram]
    if hists:
        width = min(max(len(g.accepted_histogram) for g in hists), 16)
        lines += ["", "## Accepted draft tokens per round (share of rounds; tree-* rows draft token trees)", "",
                  "| method | γ | T | tokens/call | " + " | ".join(str(k) for k in range(width)) + " |",
                  "|---|---|---|---|" + "---|" * width]
        for g in hists:
            total = sum(g.accepted_histogram) or 1
            shares = [c / total for c in g.accepted_histogram[:width]] + [0.0] * (width - len(g.accepted_histogram[:width]))
            lines.append(f"| {g.what} | {g.gamma} | {g.temperature:g} | {_fmt(g.tokens_per_call)} | " + " | ".join(f"{x:.2f}" for x in shares) + " |")
    if bvt:
        lines += ["", "## Block vs token verification (tokens per target call, paired by prompt and seed)", "",
                  "| T | γ | pairs | token ± SE | block ± SE | block / token | mean difference ± SE |",
                  "|---|---|---|---|---|---|---|"]
        for b in bvt:
            lines.append(f"| {b.temperature:g} | {b.gamma} | {b.n_pairs} | {b.token_tpc:.3f} ± {b.token_se:.3f} | {b.block_tpc:.3f} ± {b.block_se:.3f} "
                         f"| {b.ratio:.3f} | {b.diff:+.3f} ± {b.diff_se:.3f} |")
    return lines


def _drafter_table(rows: list[DrafterCategory]) -> list[str]:
    """Every drafter of the run × T × prompt category, side by side (runs with ``--draft A,B``)."""
    if not rows:
        return []
    lines = ["", "## Drafters side by side, by prompt category", "",
             "Tokens/call = generated tokens / target calls; acceptance k = P(accepted ≥ k | drafted ≥ k); draft step = "
             "draft time / drafted tokens (a tree counts every node); ×plain = median per-prompt ratio to the paired plain run.", "",
             "| drafter | method | γ | T | category | prompts | tokens/call | acceptance k=1 / 2 / 3 | draft step ms | tok/s | ×plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = " / ".join(_fmt(a) for a in (r.acceptance_per_position + [math.nan] * 3)[:3])
        lines.append(f"| {r.draft} | {r.method} | {r.gamma or '–'} | {r.temperature:g} | {r.category} | {r.n} | {_fmt(r.tokens_per_call)} "
                     f"| {acc} | {_fmt(r.draft_step_ms)} | {r.tokens_per_s_median:.1f} | {_fmt(r.speedup)} |")
    return lines


def _llamacpp_table(stats: list[GroupStats]) -> list[str]:
    """Every local row next to llama.cpp plain decoding of the same GGUF (when it ran)."""
    if not any(g.mode == LLAMACPP_PLAIN for g in stats):
        return []
    lines = ["", "## Against llama.cpp on the same GGUF", "",
             "×llama.cpp = median over prompts of the per-prompt tok/s ratio to llama.cpp plain decoding (same prompt, "
             "seed and temperature; when the speculative mode ran, llama.cpp ran in its process among specdec's runs of "
             "each prompt, the order of all of them turned one place on from prompt to prompt). Decode tok/s leaves out the prompt's forward pass. Greedy output = llama.cpp plain: prompts "
             "whose greedy tokens equal llama.cpp plain decoding's.", "",
             "| mode | γ | T | tok/s median | decode tok/s | ×llama.cpp plain | tokens/call ± SE | acceptance | greedy output = llama.cpp plain |",
             "|---|---|---|---|---|---|---|---|---|"]
    for g in sorted(stats, key=lambda g: (g.temperature, not g.mode.startswith("llamacpp_"), g.mode)):
        if g.mode in ("hf_plain", "hf_assisted", "edge_only"):
            continue
        same = f"{g.same_tokens_as_llamacpp[0]}/{g.same_tokens_as_llamacpp[1]}" if g.same_tokens_as_llamacpp else "–"
        lines.append(
            f"| {_label(g)} | {g.gamma or '–'} | {g.temperature:g} | {g.tokens_per_s_median:.1f} | {_fmt(g.decode_tokens_per_s_median, 1)} "
            f"| {_fmt(g.speedup_vs_llamacpp)} | {_fmt(g.tokens_per_call)} ± {_fmt(g.tokens_per_call_se, 3)} | {_fmt(g.acceptance)} | {same} |"
        )
    return lines


def plot(stats: list[GroupStats], bvt: list[BlockVsToken], out_dir: Path) -> list[str]:
    """PNG plots; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: list[str] = []
    spec = [g for g in stats if g.mode == "speculative" and g.speedup_vs_cloud is not None]
    temps = sorted({g.temperature for g in spec})
    if spec:
        fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 4), squeeze=False)
        for ax, t in zip(axes[0], temps):
            for method in sorted({g.what for g in spec if g.temperature == t}):
                rows = [g for g in spec if g.temperature == t and g.what == method]
                fixed = sorted((int(g.gamma), g.speedup_vs_cloud) for g in rows if str(g.gamma).isdigit())
                if fixed:
                    ax.plot([x for x, _ in fixed], [y for _, y in fixed], marker="o", label=method)
                for g in rows:
                    if not str(g.gamma).isdigit():
                        ax.scatter([g.mean_gamma], [g.speedup_vs_cloud], marker="*", s=120, label=f"{method} ({g.gamma}, at mean γ)")
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set(title=f"T = {t:g}", xlabel="γ", ylabel="speed-up over plain (median)")
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "speedup_vs_gamma.png"))

        fig, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 4), squeeze=False)
        for ax, t in zip(axes[0], temps):
            for g in [g for g in spec if g.temperature == t]:
                ys = g.acceptance_per_position
                ax.plot(range(1, len(ys) + 1), ys, marker=".", label=f"{g.what} γ={g.gamma}")
            ax.set(title=f"T = {t:g}", xlabel="draft position k", ylabel="P(accepted ≥ k | drafted ≥ k)", ylim=(0, 1.02))
            ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "acceptance_per_position.png"))

        fig, ax = plt.subplots(figsize=(5, 4.5))
        xs = [g.ideal_speedup for g in spec if g.ideal_speedup]
        ys = [g.speedup_vs_cloud for g in spec if g.ideal_speedup]
        ax.scatter(xs, ys, label="measured vs engine ideal")
        pi = [(g.predicted_speedup_iid, g.speedup_vs_cloud) for g in spec if g.predicted_speedup_iid]
        ax.scatter([a for a, _ in pi], [b for _, b in pi], marker="x", label="measured vs i.i.d. formula")
        top = max(xs + ys + [a for a, _ in pi] + [1.0]) * 1.1
        ax.plot([0, top], [0, top], color="grey", ls="--", lw=0.8)
        ax.plot([0, top], [0, 0.9 * top], color="grey", ls=":", lw=0.8, label="90% of ideal")
        ax.set(xlabel="predicted speed-up", ylabel="measured speed-up", xlim=(0, top), ylim=(0, top))
        ax.legend(fontsize=7)
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "predicted_vs_measured.png"))
    if bvt:
        fig, axes = plt.subplots(1, len({b.temperature for b in bvt}), figsize=(5 * len({b.temperature for b in bvt}), 4), squeeze=False)
        for ax, t in zip(axes[0], sorted({b.temperature for b in bvt})):
            rows = [b for b in bvt if b.temperature == t]
            xs = range(len(rows))
            ax.bar([x - 0.2 for x in xs], [b.token_tpc for b in rows], 0.4, yerr=[b.token_se for b in rows], label="token")
            ax.bar([x + 0.2 for x in xs], [b.block_tpc for b in rows], 0.4, yerr=[b.block_se for b in rows], label="block")
            ax.set_xticks(list(xs), [f"γ={b.gamma}" for b in rows])
            ax.set(title=f"T = {t:g}", ylabel="tokens per target call")
            ax.legend()
        fig.tight_layout()
        paths.append(_save(fig, out_dir / "token_vs_block.png"))
    return paths


def _bar_label(r: DrafterCategory) -> str:
    return f"{r.draft}\n{r.method} {r.gamma or ''}".strip()


def plot_drafters(rows: list[DrafterCategory], out_dir: Path) -> list[str]:
    """Tokens per call and speed-up over plain per drafter, one panel per T, a bar per category."""
    if not rows:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r.temperature for r in rows})
    cats = sorted({r.category for r in rows})
    fig, axes = plt.subplots(2, len(temps), figsize=(6 * len(temps), 7), squeeze=False)
    for col, t in enumerate(temps):
        here = [r for r in rows if r.temperature == t]
        names = list(dict.fromkeys(_bar_label(r) for r in here))
        width = 0.8 / len(cats)
        for i, cat in enumerate(cats):
            by = {_bar_label(r): r for r in here if r.category == cat}
            xs = [j + (i - (len(cats) - 1) / 2) * width for j in range(len(names))]
            axes[0][col].bar(xs, [by[n].tokens_per_call if n in by else 0 for n in names], width, label=cat)
            axes[1][col].bar(xs, [(by[n].speedup or 0) if n in by else 0 for n in names], width, label=cat)
        for row, ylabel in ((0, "tokens per target call"), (1, "speed-up over paired plain")):
            ax = axes[row][col]
            ax.set_xticks(range(len(names)), names, fontsize=7, rotation=30, ha="right")
            ax.set(title=f"T = {t:g}", ylabel=ylabel)
            ax.legend(fontsize=7)
        axes[1][col].axhline(1.0, color="grey", lw=0.8, ls="--")
    fig.tight_layout()
    return [_save(fig, out_dir / "drafters.png")]


def _save(fig, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)


def write(result: dict, out_dir: str | Path, *, make_plots: bool = True) -> dict:
    """Write ``results.json``, ``README.md`` (the summary) and plots into ``out_dir``."""
    import json

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {**result, "samples": upgrade(result["samples"])}
    stats = aggregate(result["samples"], result.get("processes"))
    bvt = block_vs_token(result["samples"])
    net = netreport.aggregate_network(result["samples"])
    per_wire = netreport.bytes_by_wire(result["samples"])
    result = {**result, "groups": [asdict(g) for g in stats], "block_vs_token": [asdict(b) for b in bvt],
              "network_groups": [{**asdict(g), "label": g.label} for g in net],
              "bytes_per_token_by_wire": [asdict(b) for b in per_wire]}
    # the results first, each file whole: a run stopped while writing leaves its results.json
    # (`bench --report-only` writes the rest from it) or the last run's, never a cut-short one
    write_text(out / "results.json", json.dumps(result, indent=1))
    plots = (plot(stats, bvt, out) + plot_drafters(drafters_by_category(result["samples"]), out)
             + netreport.plot(net, per_wire, out, _save)) if make_plots else []
    write_text(out / "README.md", markdown(result, stats, bvt, plots, net))
    return {"stats": stats, "block_vs_token": bvt, "network": net, "plots": plots, "dir": str(out)}


def _resumed(parts: int | None, cfg: dict) -> list[str]:
    """The line saying a run was stopped and resumed (``bench --resume``), or none."""
    if not parts:
        return []
    times = "once" if parts == 1 else f"{parts} times"
    network = any(m in netreport.NETWORK_MODES for m in cfg.get("modes", ()))
    return [f"This run was stopped and resumed {times} (`--resume`): a prompt's rows in a mode all come from one "
            "worker process (so paired ratios stay paired), but different prompts' rows may come from different ones"
            + ("; an edge-cloud server's peak memory is the highest of its processes, the proxies' bytes are "
               "every run's added up." if network else "."), ""]


def _target_dtype(cfg: dict) -> str:
    """``auto = q4``: the target dtype asked for, and what it resolved to where the run recorded it."""
    asked, resolved = cfg.get("dtype", "float32"), cfg.get("target_precision")
    return asked if not resolved or resolved == asked else f"{asked} = {resolved}"


def _kv_dtype(cfg: dict) -> str:
    """", key/value cache float16" where the run asked for a cache other than the target's own dtype."""
    kv = cfg.get("kv_dtype", "auto")
    return "" if kv == "auto" else f", key/value cache {kv}"


def _tree_floor(cfg: dict) -> str:
    """", tree floor P" where the run drafted token trees (greedy / coupled trees leave out nodes below it)."""
    if not any(str(g).startswith("tree-") for g in cfg.get("gammas", ())) or cfg.get("tree_min_prob") is None:
        return ""
    return f", tree probability floor {cfg['tree_min_prob']:g}"


def _draft_vocab(cfg: dict) -> str:
    """", full vocabulary" where the run asked the draft model for every token (``--draft-vocab full``),
    ", its own and the full vocabulary side by side" where it compared both (``auto,full``)."""
    vocab = str(cfg.get("draft_vocab") or "auto").replace(" ", "")
    if vocab == "full":
        return ", full vocabulary"
    return ", its own and the full vocabulary side by side" if "," in vocab else ""


def _draft_temperature(samples: list[dict]) -> str:
    """", sampled at 0.85 × T" where the speculative rows at T > 0 drew their drafts at a factor
    other than 1 (``--draft-temperature-factor``; rows record the factor each drafter used)."""
    factors = sorted({float(s["draft_temperature_factor"]) for s in samples
                      if s.get("draft_temperature_factor") not in (None, 1.0) and float(s.get("temperature", 0)) > 0})
    return f", sampled at {' / '.join(f'{f:g}' for f in factors)} × T" if factors else ""


def _draft_dtype(cfg: dict) -> str:
    """``auto = w8a8``: the draft dtype asked for, and what it resolved to where the run recorded it."""
    resolved = cfg.get("draft_precision")
    return cfg["draft_dtype"] if not resolved or resolved == cfg["draft_dtype"] else f"{cfg['draft_dtype']} = {resolved}"


def machine_line(machine: dict) -> str:
    """"AMD EPYC (AVX2, no native bf16), 2 cores, torch 2.13.0+cpu" from ``machine_info()``."""
    cpu = machine.get("cpu", "?")
    features = []
    if machine.get("cpu_capability"):
        features.append(str(machine["cpu_capability"]))
    if "cpu_bf16" in machine:
        features.append("native bf16" if machine["cpu_bf16"] else "no native bf16")
    if machine.get("cpu_amx_int8"):
        features.append("AMX int8")
    if machine.get("int8_kernel"):
        features.append(f"int8 kernel {machine['int8_kernel']}")
    if machine.get("q4_kernel"):
        features.append(f"q4 kernel {machine['q4_kernel']}")
    if machine.get("q8_kernel"):
        features.append(f"few-row int8 kernel {machine['q8_kernel']}")
    if "huge_pages" in machine:
        features.append("weights on huge pages" if machine["huge_pages"] else "weights on 4 KiB pages")
    if features:
        cpu += f" ({', '.join(features)})"
    return f"{cpu}, {machine.get('cpu_count', '?')} cores, torch {machine.get('torch', '?')}"
