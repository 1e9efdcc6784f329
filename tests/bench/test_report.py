"""Metric computation on synthetic samples (no timing involved)."""

import json
import math
import re

import pytest

from specdec.bench import report, theory, workloads
from specdec.bench.workloads import BUILTIN, load_jsonl, select
from specdec.errors import ConfigError


def _engine(mode, method, prompt, tps, *, gamma=None, t=0.0, seed=0, calls=10, gen=20, prop=0, acc=0,
            per_pos=(), prop_pos=(), draft_s=0.0, target_s=0.5, cat="code", **extra):
    return {
        "mode": mode, "method": method, "gamma": gamma, "temperature": t, "prompt_id": prompt, "category": cat,
        "seed": seed, "tokens_per_s": tps, "wall_s": gen / tps, "ttft_s": 0.05, "generated_tokens": gen,
        "target_calls": calls, "tokens_per_target_call": gen / calls, "draft_tokens_proposed": prop,
        "draft_tokens_accepted": acc, "acceptance_per_position": list(per_pos), "proposed_per_position": list(prop_pos),
        "draft_s": draft_s, "target_s": target_s, "verify_s": 0.01, "kv_peak_bytes": 1000, "lossless": True, **extra,
    }


def _samples():
    rows = []
    for i, (p, cat) in enumerate([("a", "code"), ("b", "code"), ("c", "chat")]):
        rows.append(_engine("plain", "plain", p, 50.0, calls=20, gen=20, target_s=0.36, cat=cat))
        rows.append({**_engine("hf_assisted", "hf_assisted", p, 25.0, cat=cat)})
        # speculative: 2x, 2x, 1x the cloud rate; 10 rounds, 20 tokens, 40 drafted, 10 accepted
        rows.append(_engine("speculative", "block", p, [100.0, 100.0, 50.0][i], gamma="4", calls=10, gen=20, prop=40,
                            acc=10, per_pos=(0.5, 0.3, 0.2, 0.0), prop_pos=(10, 10, 10, 10), draft_s=0.04, target_s=0.2, cat=cat))
    return rows


def test_aggregate_speedups_and_engine_metrics():
    stats = {(g.mode, g.method): g for g in report.aggregate(_samples(), {"speculative": {"rss_peak_bytes": 4000}})}
    spec = stats[("speculative", "block")]
    assert spec.n == 3
    assert spec.speedup_vs_cloud == pytest.approx(2.0)  # median of 2, 2, 1
    assert spec.speedup_by_category == {"chat": pytest.approx(1.0), "code": pytest.approx(2.0)}
    assert spec.speedup_vs_hf_assisted == pytest.approx(4.0)
    assert spec.tokens_per_call == pytest.approx(2.0) and spec.acceptance == pytest.approx(0.25)
    assert spec.acceptance_per_position == pytest.approx([0.5, 0.3, 0.2, 0.0])
    assert spec.mean_gamma == pytest.approx(4.0)
    assert spec.cloud_calls_per_token == pytest.approx(0.5)
    assert spec.draft_step_ms == pytest.approx(1.0) and spec.verify_ms == pytest.approx(20.0)
    assert spec.kv_share_of_rss == pytest.approx(0.25)
    # theory: plain target step = 0.36 s / 20 calls = 18 ms; c = 1 ms / 18 ms
    assert spec.cost_ratio_c == pytest.approx(1 / 18)
    ideal_tps = 2.0 / (4 * 0.001 + 0.020)
    assert spec.ideal_speedup == pytest.approx(ideal_tps * 0.018)
    assert spec.speedup_decode is None  # no prompt pass recorded: efficiency from the wall-clock ratio
    assert spec.efficiency == pytest.approx(2.0 / spec.ideal_speedup)


def test_efficiency_leaves_the_prompt_pass_out_as_the_ideal_does():
    # a long prompt: each run spends 0.2 s on it; decoding alone is 2x, 2x, 1x faster, wall clock less
    rows = []
    for s in _samples():
        if s["mode"] in ("plain", "speculative"):
            decode = s["generated_tokens"] / s["tokens_per_s"]  # the wall time above, now decoding only
            wall = decode + 0.2
            rows.append({**s, "prefill_s": 0.2, "wall_s": wall, "tokens_per_s": s["generated_tokens"] / wall})
    stats = {(g.mode, g.method): g for g in report.aggregate(rows)}
    spec = stats[("speculative", "block")]
    assert spec.speedup_decode == pytest.approx(2.0)  # median of 2, 2, 1
    assert spec.speedup_vs_cloud == pytest.approx((0.4 + 0.2) / (0.2 + 0.2))  # 20 tokens: 0.4 s vs 0.2 s decoding
    assert spec.efficiency == pytest.approx(2.0 / spec.ideal_speedup)


def test_block_vs_token_is_paired():
    rows = []
    for p in "abcd":
        for seed in (0, 1):
            rows.append(_engine("speculative", "token", p, 10, gamma="8", t=1.0, seed=seed, calls=10, gen=20))
            rows.append(_engine("speculative", "block", p, 10, gamma="8", t=1.0, seed=seed, calls=10, gen=22 + seed))
    [b] = report.block_vs_token(rows)
    assert b.n_pairs == 8 and b.token_tpc == pytest.approx(2.0) and b.block_tpc == pytest.approx(2.25)
    assert b.ratio == pytest.approx(1.125) and b.diff == pytest.approx(0.25)
    assert b.diff_se == pytest.approx(0.05 * (8 / 7) ** 0.5 / 8**0.5)


def test_write_produces_json_markdown_and_plots(tmp_path):
    result = {"config": {"target": "t", "draft": "d", "draft_dtype": "auto", "prompts": [{"category": "code"}],
                         "max_new_tokens": 20, "repeats": 1, "seed": 0, "top_p": None, "repetition_penalty": None,
                         "batch_invariant": True, "command": "specdec bench --x"},
              "samples": _samples(), "processes": {}, "machine": {"cpu": "test"}}
    out = report.write(result, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert {"config", "samples", "groups", "block_vs_token"} <= set(saved)
    md = (tmp_path / "README.md").read_text()
    assert "specdec bench --x" in md and "speculative/block" in md and "| 2.00 |" in md
    assert out["plots"] and all((tmp_path / p.split("/")[-1]).is_file() for p in out["plots"])
    assert "cloud_only" not in md and "×plain" in md
    assert "(draft dtype auto)" in md  # an older run that did not record what auto resolved to


def test_report_says_what_the_draft_dtype_resolved_to(tmp_path):
    cfg = {"target": "t", "draft": "d", "draft_dtype": "auto", "draft_precision": "w8a8", "prompts": [{"category": "code"}],
           "max_new_tokens": 20, "repeats": 1, "seed": 0, "top_p": None, "repetition_penalty": None, "batch_invariant": True}
    report.write({"config": cfg, "samples": _samples(), "processes": {}, "machine": {"cpu": "test"}}, tmp_path)
    assert "(draft dtype auto = w8a8)" in (tmp_path / "README.md").read_text()
    report.write({"config": {**cfg, "draft_dtype": "w8a8"}, "samples": _samples(), "processes": {}, "machine": {"cpu": "test"}}, tmp_path)
    assert "(draft dtype w8a8)" in (tmp_path / "README.md").read_text()


def test_report_says_at_what_factor_the_draft_sampled(tmp_path):
    cfg = {"target": "t", "draft": "d", "draft_dtype": "w8a8", "prompts": [{"category": "code"}],
           "max_new_tokens": 20, "repeats": 1, "seed": 0, "top_p": None, "repetition_penalty": None, "batch_invariant": True}
    rows = _samples()
    sampled = [{**r, "temperature": 1.0, "draft_temperature_factor": 0.85} for r in rows if r["mode"] == "speculative"]
    report.write({"config": cfg, "samples": rows + sampled, "processes": {}, "machine": {"cpu": "test"}}, tmp_path)
    assert "(draft dtype w8a8, sampled at 0.85 × T)" in (tmp_path / "README.md").read_text()
    greedy_only = [{**r, "draft_temperature_factor": 0.85} for r in rows]  # T = 0: no factor applies
    report.write({"config": cfg, "samples": greedy_only, "processes": {}, "machine": {"cpu": "test"}}, tmp_path)
    assert "(draft dtype w8a8)" in (tmp_path / "README.md").read_text()


def test_old_results_with_cloud_only_rows_still_aggregate():
    old = [{**s, "mode": "cloud_only", "method": "cloud_only"} if s["mode"] == "plain" else s for s in _samples()]
    new = {(g.mode, g.method): g.speedup_vs_cloud for g in report.aggregate(_samples())}
    assert {(g.mode, g.method): g.speedup_vs_cloud for g in report.aggregate(old)} == new
    assert report.upgrade(old) != old and all(s["mode"] != "cloud_only" for s in report.upgrade(old))
    spec = {(g.mode, g.method): g for g in report.aggregate(old)}[("speculative", "block")]
    assert spec.speedup_vs_cloud == pytest.approx(2.0)


def test_workloads(tmp_path):
    assert {p.category for p in BUILTIN} == {"code", "chat"} and len(BUILTIN) >= 8
    assert [p.category for p in select(BUILTIN, limit=2)] == ["code", "code", "chat", "chat"]
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "x", "category": "c"}\n\n{"prompt": "y", "chat": true}\n')
    ps = load_jsonl(f)
    assert [(p.category, p.chat) for p in ps] == [("c", False), ("custom", True)]
    f.write_text('{"nope": 1}\n')
    with pytest.raises(ConfigError, match="prompt"):
        load_jsonl(f)
    with pytest.raises(ConfigError, match="does not exist"):
        load_jsonl(tmp_path / "missing.jsonl")
    # rows pair by id, so a repeated id ran one prompt in the other's place; "false" read as chat on
    for text, says in (('{"prompt": "a", "id": "p"}\n{"prompt": "b", "id": "p"}', ":2: id 'p' repeats line 1's"),
                       ('{"prompt": "a"}\n{"prompt": "b", "id": "line1"}', ":2: id 'line1' repeats line 1's"),
                       ('{"prompt": "a", "chat": "false"}', ':1: \'chat\' must be true or false, got "false"'),
                       ('{"prompt": "a", "catgory": "chat"}', ":1: unknown field 'catgory'"),
                       ('{"prompt": "a", "category": ["x"]}', ":1: 'category' must be a string")):
        f.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_jsonl(f)
    f.write_bytes(b'\xff\xfe{"prompt": "a"}')
    with pytest.raises(ConfigError, match="is not valid UTF-8"):
        load_jsonl(f)
    # json.dumps(..., ensure_ascii=False) writes U+2028 as it is: one line, not two
    f.write_text(json.dumps({"prompt": "a\u2028b\u0085c"}, ensure_ascii=False) + "\r\n", encoding="utf-8")
    assert [p.text for p in load_jsonl(f)] == ["a\u2028b\u0085c"]


def test_speculative_rows_use_the_paired_plain_run_when_present():
    rows = _samples() + [_engine("plain_paired", "plain_paired", p, 25.0, calls=20, gen=20, target_s=0.5, cat=c)
                         for p, c in (("a", "code"), ("b", "code"), ("c", "chat"))]
    stats = {(g.mode, g.method): g for g in report.aggregate(rows)}
    assert stats[("speculative", "block")].speedup_vs_cloud == pytest.approx(4.0)  # 100/25, 100/25, 50/25
    assert stats[("speculative", "block")].cost_ratio_c == pytest.approx(1 / 25)  # plain step 0.5 s / 20
    assert stats[("hf_assisted", "hf_assisted")].speedup_vs_cloud == pytest.approx(0.5)  # still vs cloud_only


def test_coupled_rows_use_plain_seeded_sampling_as_their_reference():
    """At T > 0 the coupled rows are paired with plain_paired_coupled (plain decoding that draws by
    Gumbel-max as they do), the block rows still with plain_paired, also in the drafter table; the
    seeded-identity table counts the coupled rows whose tokens equal plain seeded sampling's."""
    rows = []
    for p, cat in (("a", "code"), ("b", "code"), ("c", "chat")):
        rows.append({**_engine("plain_paired", "plain_paired", p, 50.0, t=1.0, calls=20, gen=20, target_s=0.4, cat=cat), "tokens_sha1": "blk"})
        rows.append({**_engine(report.PAIRED_COUPLED, report.PAIRED_COUPLED, p, 40.0, t=1.0, calls=20, gen=20, target_s=0.5, cat=cat),
                     "tokens_sha1": f"g{p}"})
        for method, draft in (("block", "d"), ("coupled", "d"), ("coupled", "ngram")):
            rows.append({**_engine("speculative", method, p, 60.0, gamma="auto", t=1.0, calls=10, gen=20, prop=20, acc=10,
                                   per_pos=(0.5,), prop_pos=(20,), draft_s=0.02, target_s=0.2, cat=cat),
                         "draft": draft, "tokens_sha1": f"g{p}" if (draft, p) != ("ngram", "c") else "other"})
    stats = {(g.mode, g.method, g.draft): g for g in report.aggregate(rows)}
    assert stats[("speculative", "block", "d")].speedup_vs_cloud == pytest.approx(60 / 50)
    assert stats[("speculative", "block", "d")].cost_ratio_c == pytest.approx(1e-3 / 0.02)  # plain_paired: 0.4 s / 20
    assert stats[("speculative", "coupled", "d")].speedup_vs_cloud == pytest.approx(60 / 40)
    assert stats[("speculative", "coupled", "d")].cost_ratio_c == pytest.approx(1e-3 / 0.025)  # its own: 0.5 s / 20
    table = {(r.draft, r.method, r.category): r.speedup for r in report.drafters_by_category(rows)}
    assert table[("d", "block", "chat")] == pytest.approx(1.2) and table[("ngram", "coupled", "chat")] == pytest.approx(1.5)
    assert report.seeded_identity(rows) == [("speculative coupled · d γ=auto", 1.0, 3, 3), ("speculative coupled · ngram γ=auto", 1.0, 2, 3)]
    # a result written before the coupled reference existed: coupled rows fall back to plain_paired
    old = [r for r in rows if r["mode"] != report.PAIRED_COUPLED]
    assert {(g.method, g.draft): g.speedup_vs_cloud for g in report.aggregate(old)}[("coupled", "d")] == pytest.approx(1.2)
    assert report.seeded_identity(old) == []


def test_machine_line_names_the_cpu_features():
    m = {"cpu": "AMD EPYC", "cpu_count": 2, "torch": "2.13.0+cpu", "cpu_capability": "AVX2", "cpu_bf16": False}
    assert report.machine_line(m) == "AMD EPYC (AVX2, no native bf16), 2 cores, torch 2.13.0+cpu"
    assert report.machine_line({"cpu": "X", "cpu_count": 4, "torch": "t"}) == "X, 4 cores, torch t"
    m = {"cpu": "Xeon", "cpu_count": 2, "torch": "t", "cpu_capability": "AVX512", "cpu_amx_int8": True, "int8_kernel": "onednn"}
    assert report.machine_line(m) == "Xeon (AVX512, AMX int8, int8 kernel onednn), 2 cores, torch t"
    m = {"cpu": "AMD EPYC", "cpu_count": 2, "torch": "t", "cpu_capability": "AVX2", "q4_kernel": "avx2"}
    assert report.machine_line(m) == "AMD EPYC (AVX2, q4 kernel avx2), 2 cores, torch t"
    m["q8_kernel"] = "avx2"
    assert report.machine_line(m) == "AMD EPYC (AVX2, q4 kernel avx2, few-row int8 kernel avx2), 2 cores, torch t"
    m["huge_pages"] = True  # older results, without the field, say nothing of pages
    assert report.machine_line(m) == "AMD EPYC (AVX2, q4 kernel avx2, few-row int8 kernel avx2, weights on huge pages), 2 cores, torch t"
    m["huge_pages"] = False
    assert report.machine_line(m).endswith("weights on 4 KiB pages), 2 cores, torch t")


def test_bench_command_names_the_environment_that_changes_what_runs():
    from specdec.bench.cli import command_line

    assert command_line(["--modes", "plain"], {}) == "specdec bench --modes plain"
    env = {"SPECDEC_INT8_KERNEL": "onednn", "HOME": "/x"}
    assert command_line(["--out", "a b"], env) == "SPECDEC_INT8_KERNEL=onednn specdec bench --out 'a b'"


def test_gamma_labels_sort_numerically_then_policies():
    from specdec.bench.netreport import gamma_order

    assert sorted(["auto", "12", "4", "guide", "8", "16"], key=gamma_order) == ["4", "8", "12", "16", "auto", "guide"]


def test_report_only_rerenders_a_committed_result(tmp_path, capsys):
    from specdec.cli import main

    result = {"config": {"target": "t", "draft": "d", "draft_dtype": "auto", "prompts": [{"category": "code"}],
                         "max_new_tokens": 20, "repeats": 1, "seed": 0, "top_p": None, "repetition_penalty": None,
                         "batch_invariant": True, "command": "specdec bench --x"},
              "samples": _samples(), "processes": {}, "machine": {"cpu": "test"}}
    (tmp_path / "results.json").write_text(json.dumps(result))
    assert main(["bench", "--report-only", "--no-plots", "--out", str(tmp_path)]) == 0
    assert "speculative/block" in (tmp_path / "README.md").read_text()
    # a folder without a result: one-line error, exit 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["bench", "--report-only", "--out", str(empty)]) == 2
    assert "results.json does not exist" in capsys.readouterr().err


def test_greedy_identity_counts_rows_equal_to_plain():
    from specdec.bench.report import greedy_identity

    rows = [
        {"mode": "plain_paired", "temperature": 0, "prompt_id": "a", "seed": 0, "tokens_sha1": "x"},
        {"mode": "plain_paired", "temperature": 0, "prompt_id": "b", "seed": 0, "tokens_sha1": "y"},
        {"mode": "speculative", "method": "greedy", "gamma": "auto", "temperature": 0, "prompt_id": "a", "seed": 0, "tokens_sha1": "x"},
        {"mode": "speculative", "method": "greedy", "gamma": "auto", "temperature": 0, "prompt_id": "b", "seed": 0, "tokens_sha1": "z"},
        {"mode": "speculative", "method": "block", "gamma": "auto", "temperature": 1, "prompt_id": "a", "seed": 0, "tokens_sha1": "q"},
    ]
    assert greedy_identity(rows) == [("speculative greedy γ=auto", 1, 2)]


def test_a_worker_killed_by_a_signal_is_named_in_the_error():
    """A crash in native code (llama.cpp's AMX kernel segfaulted on a Sapphire Rapids machine)
    prints no traceback: the error must still say what happened."""
    import os

    from specdec.bench.runner import _run_worker
    from specdec.errors import SpecdecError

    crash = ["sh", "-c", "kill -SEGV $$", "sh"]  # the worker's own command line becomes sh's arguments
    with pytest.raises(SpecdecError, match="killed by SIGSEGV.*llama.cpp"):
        _run_worker({"mode": "llamacpp"}, dict(os.environ), crash, "llamacpp", lambda row: None)
    with pytest.raises(SpecdecError, match=r"killed by SIGSEGV \(a crash in native code\)"):
        _run_worker({"mode": "plain"}, dict(os.environ), crash, "plain", lambda row: None)


def test_an_interrupted_bench_stops_its_worker(monkeypatch):
    """Ctrl-C or SIGTERM while a worker runs (here: the first sample's handling is interrupted):
    the worker is stopped, not left running on its own (it used to keep a core busy until its
    next write failed, minutes with a slow model)."""
    import os
    import subprocess

    from specdec.bench import runner

    started: list[subprocess.Popen] = []
    real = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(runner.subprocess, "Popen", popen)
    slow = ["sh", "-c", "echo '{\"sample\": 1}'; exec sleep 60", "sh"]  # one sample, then a long run

    def interrupted(row):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        runner._run_worker({"mode": "plain"}, dict(os.environ), slow, "plain", interrupted)
    assert len(started) == 1 and started[0].poll() is not None  # stopped, and reaped


def _spec(prompt, tps, **kw):  # a block-rule speculative row; kw overrides its defaults too
    kw = {"gamma": "4", "prop": 40, "acc": 10, "draft_s": 0.04, "target_s": 0.2, **kw}
    return _engine("speculative", "block", prompt, tps, **kw)


def _group(samples, mode="speculative"):
    return next(g for g in report.aggregate(samples) if g.mode == mode)


def test_tokens_per_call_is_the_mean_of_the_prompts_ratios():
    """tokens/call ± SE is the mean (not the median) of each prompt's generated / calls."""
    rows = [_spec("a", 100.0, calls=20, gen=20), _spec("b", 100.0, calls=20, gen=20), _spec("c", 100.0, calls=5, gen=20)]
    g = _group(rows)
    assert g.tokens_per_call == pytest.approx(2.0)  # mean of 1, 1, 4 (the median would be 1)


def test_ttft_and_category_figures_are_medians():
    """TTFT, tok/s by category and ×plain by category are medians over the prompts, not means."""
    rows = []
    for p, tps, ttft in (("a", 60.0, 0.01), ("b", 60.0, 0.02), ("c", 150.0, 0.30)):
        rows.append(_engine("plain", "plain", p, 30.0, calls=20))
        rows.append({**_spec(p, tps), "ttft_s": ttft})
    g = _group(rows)
    assert g.ttft_median_s == pytest.approx(0.02)
    assert g.tokens_per_s_by_category == {"code": pytest.approx(60.0)}
    assert g.speedup_by_category == {"code": pytest.approx(2.0)}


def test_a_reference_run_with_zero_tokens_per_second_is_left_out_of_the_ratios():
    """A plain run at 0 tok/s (nothing generated) gives no ratio: the speed-up is the other prompts'."""
    rows = [_engine("plain", "plain", "a", 50.0, calls=20), {**_engine("plain", "plain", "b", 50.0, calls=20), "tokens_per_s": 0.0},
            _spec("a", 100.0), _spec("b", 100.0)]
    assert _group(rows).speedup_vs_cloud == pytest.approx(2.0)


def test_a_row_whose_wall_time_is_all_prompt_pass_has_no_decode_rate():
    """wall_s == prefill_s leaves no decoding time: no decode tok/s (None), no division by zero."""
    row = {**_spec("a", 100.0), "prefill_s": 0.2}
    row["wall_s"] = 0.2
    assert report._decode_tps(row) is None
    assert _group([row]).decode_tokens_per_s_median is None


def test_one_lossy_row_marks_the_group_lossy_in_the_summary():
    """A group is lossless only if every row is; the summary labels a lossy group "(LOSSY)"."""
    rows = [_spec("a", 100.0), {**_spec("b", 100.0), "lossless": False}]
    g = _group(rows)
    assert g.lossless is False
    md = "\n".join(report._local_tables([g], []))
    assert "| speculative/block (LOSSY) | 4 |" in md


def test_target_share_and_kv_peak_use_the_right_fields():
    """target share = Σ target_s / Σ wall_s (not verify_s); KV peak is the largest row's."""
    rows = [_spec("a", 100.0), {**_spec("b", 100.0), "kv_peak_bytes": 5000}]
    g = _group(rows)
    assert g.target_share == pytest.approx(1.0)  # 0.2 s of each 0.2 s row
    assert g.verify_share == pytest.approx(0.02 / 0.4)
    assert g.kv_peak_bytes == 5000


def test_block_vs_token_pairs_only_the_prompts_both_ran():
    """A token row with no block row of the same prompt and seed is left out (not a KeyError)."""
    rows = [_engine("speculative", "token", "a", 10.0, gamma="4", calls=10), _engine("speculative", "block", "a", 10.0, gamma="4", calls=5),
            _engine("speculative", "token", "b", 10.0, gamma="4", calls=10)]
    (b,) = report.block_vs_token(rows)
    assert b.n_pairs == 1 and b.token_tpc == pytest.approx(2.0) and b.block_tpc == pytest.approx(4.0)


def test_drafter_table_draft_step_is_per_drafted_token():
    """The drafter table's draft step = draft time / drafted tokens (not / target calls)."""
    rows = [_engine("plain_paired", "plain", "a", 50.0),
            {**_spec("a", 100.0), "draft": "x"}, {**_spec("a", 100.0), "draft": "y"}]
    by = {r.draft: r for r in report.drafters_by_category(rows)}
    assert by["x"].draft_step_ms == pytest.approx(1.0)  # 40 ms over 40 drafted tokens
    assert by["x"].speedup == pytest.approx(2.0)


def test_summary_puts_hf_assisted_and_hf_plain_in_their_columns():
    """The summary's ×HF assisted and ×HF plain cells hold those two ratios, in the header's order."""
    rows = [_engine("hf_assisted", "hf_assisted", "a", 25.0), _engine("hf_plain", "hf_plain", "a", 20.0), _spec("a", 100.0)]
    md = "\n".join(report._local_tables(report.aggregate(rows), []))
    header = next(line for line in md.splitlines() if line.startswith("| mode |"))
    row = next(line for line in md.splitlines() if line.startswith("| speculative/block"))
    cells = dict(zip([c.strip() for c in header.split("|")], [c.strip() for c in row.split("|")]))
    assert cells["×HF assisted"] == "4.00" and cells["×HF plain"] == "5.00"


def test_select_keeps_only_the_categories_asked_for():
    """--categories chat keeps the chat prompts alone (in their order), with --limit per category."""
    chosen = select(BUILTIN, categories=["chat"], limit=2)
    assert [p.category for p in chosen] == ["chat", "chat"]
    assert [p.id for p in chosen] == [p.id for p in BUILTIN if p.category == "chat"][:2]


def test_a_prompt_without_an_id_is_named_by_its_line_in_the_file(tmp_path):
    """A prompt with no id is "lineN", N its line in the file (blank lines counted), so it names the line to edit."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "x"}\n\n{"prompt": "y"}\n')
    assert [p.id for p in load_jsonl(path)] == ["line1", "line3"]


def test_groups_sort_by_gamma_then_temperature_within_a_method():
    """Within a mode and method: γ (numbers, then policies) first, then temperature."""
    rows = [_spec("a", 100.0, gamma=g, t=t) for t in (1.0, 0.0) for g in ("8", "4")]
    assert [(g.gamma, g.temperature) for g in report.aggregate(rows)] == [
        ("4", 0.0), ("4", 1.0), ("8", 0.0), ("8", 1.0)]


def test_drafters_keep_the_order_the_run_listed_them():
    """``--draft z,a``: z's rows come before a's, in the summary and the drafter table."""
    rows = [{**_spec("a", 100.0), "draft": d} for d in ("z", "a")]
    assert [g.draft for g in report.aggregate(rows)] == ["z", "a"]
    assert [r.draft for r in report.drafters_by_category(rows)] == ["z", "a"]


def test_peak_rss_and_kv_are_the_largest_rows_without_a_process_record():
    """No process record: peak RSS is the largest row's; the KV peak is the largest row's too (whatever the order)."""
    rows = [{**_spec("a", 100.0), "rss_peak_bytes": 100, "kv_peak_bytes": 5000},
            {**_spec("b", 100.0), "rss_peak_bytes": 300, "kv_peak_bytes": 1000}]
    g = report.aggregate(rows)[0]
    assert g.rss_peak_bytes == 300 and g.kv_peak_bytes == 5000


def test_the_drafter_table_and_block_vs_token_take_the_right_rows():
    """Rows of a run of one drafter (draft None) are not in the drafter table; rows of a run that
    compared drafters are not in the block-vs-token pairs (those pair one drafter's rows)."""
    single = [{**_engine("speculative", m, "a", 10.0, gamma="4"), "draft": None} for m in ("token", "block")]
    assert report.drafters_by_category(single) == []
    assert len(report.block_vs_token(single)) == 1
    multi = [{**r, "draft": "x"} for r in single]
    assert report.block_vs_token(multi) == []


def test_greedy_identity_pairs_by_seed_and_uses_only_greedy_references():
    """The reference is the plain run at T = 0 of the same prompt *and seed*; a plain row at T > 0
    is never a reference; drafters get their own rows."""
    rows = [
        {"mode": "plain_paired", "temperature": 0, "prompt_id": "a", "seed": 0, "tokens_sha1": "x0"},
        {"mode": "plain_paired", "temperature": 0, "prompt_id": "a", "seed": 1, "tokens_sha1": "x1"},
        {"mode": "plain_paired", "temperature": 1.0, "prompt_id": "a", "seed": 1, "tokens_sha1": "sampled"},
    ]
    for seed in (0, 1):
        for d in ("d1", "d2"):
            rows.append({"mode": "speculative", "method": "greedy", "gamma": "4", "temperature": 0, "prompt_id": "a",
                         "seed": seed, "draft": d, "tokens_sha1": f"x{seed}"})
    assert report.greedy_identity(rows) == [("speculative greedy · d1 γ=4", 2, 2), ("speculative greedy · d2 γ=4", 2, 2)]


def test_the_header_helpers_say_what_the_run_resolved():
    assert report._resumed(1, {})[0].startswith("This run was stopped and resumed once (`--resume`)")
    assert "3 times" in report._resumed(3, {})[0]
    assert "the proxies' bytes are every run's added up" in report._resumed(2, {"modes": ["plain", "edge_cloud"]})[0]
    assert "proxies" not in report._resumed(2, {"modes": ["plain"]})[0]
    assert report._target_dtype({"dtype": "auto", "target_precision": "q4"}) == "auto = q4"
    assert report._target_dtype({"dtype": "q4", "target_precision": "q4"}) == "q4"
    assert report._kv_dtype({"kv_dtype": "float16"}) == ", key/value cache float16" and report._kv_dtype({}) == ""
    assert report._tree_floor({"gammas": ["4"], "tree_min_prob": 0.1}) == ""  # no trees drafted: no floor applies
    assert report._tree_floor({"gammas": ["4", "tree-8"], "tree_min_prob": 0.1}) == ", tree probability floor 0.1"
    assert report._draft_vocab({"draft_vocab": "auto, full"}) == ", its own and the full vocabulary side by side"
    assert report._draft_vocab({"draft_vocab": "full"}) == ", full vocabulary" and report._draft_vocab({}) == ""


def _cfg():
    return {"target": "t", "draft": "d", "draft_dtype": "auto", "prompts": [{"category": "code"}], "max_new_tokens": 20,
            "repeats": 1, "seed": 0, "top_p": None, "repetition_penalty": None, "batch_invariant": True}


def test_write_uses_the_process_records_and_names_multi_process_modes(tmp_path):
    """write() passes the per-mode process records on (peak RSS of the speculative group), and the
    processes table says '(N processes)' only for a mode that ran in more than one."""
    procs = {"speculative": {"rss_peak_bytes": 4 * 2**20, "seconds": 3, "workers": 2}, "plain": {"rss_peak_bytes": 2**20, "seconds": 1, "workers": 1}}
    report.write({"config": _cfg(), "samples": _samples(), "processes": procs, "machine": {}}, tmp_path, make_plots=False)
    groups = {g["mode"]: g for g in json.loads((tmp_path / "results.json").read_text())["groups"]}
    assert groups["speculative"]["rss_peak_bytes"] == 4 * 2**20
    md = (tmp_path / "README.md").read_text()
    assert "| speculative (2 processes) | 4 | 3 |" in md and "| plain | 1 | 1 |" in md


def test_the_accepted_histogram_shows_at_most_16_columns():
    rows = [_spec("a", 100.0, accepted_histogram=[1] * 20)]
    lines = report._local_tables(report.aggregate(rows), [])
    assert "| method | γ | T | tokens/call | " + " | ".join(str(k) for k in range(16)) + " |" in lines


def test_greedy_agreement_with_llamacpp_skips_prompts_whose_reference_has_no_digest():
    """A llama.cpp plain row without a tokens digest is not a prompt the other row disagreed on."""
    from .test_llamacpp_rows import _row

    rows = [_row("llamacpp_plain", "a", 100.0, sha="pa"), _row("llamacpp_plain", "b", 100.0, sha=None),
            _row("llamacpp_spec", "a", 150.0, sha="pa"), _row("llamacpp_spec", "b", 150.0, sha="pb")]
    spec = next(g for g in report.aggregate(rows) if g.mode == "llamacpp_spec")
    assert spec.same_tokens_as_llamacpp == (1, 1)


def test_the_llamacpp_table_leaves_out_the_hf_and_edge_only_rows():
    """Against llama.cpp: specdec's own rows and llama.cpp's, not HF's nor the draft-only edge_only row."""
    from .test_llamacpp_rows import _row

    rows = [_row("llamacpp_plain", "a", 100.0)]
    rows += [{**_engine(m, m, "a", 50.0), "tokens_sha1": "x"} for m in ("edge_only", "hf_plain", "plain")]
    lines = report._llamacpp_table(report.aggregate(rows))
    modes = [line.split("|")[1].strip() for line in lines if line.startswith("| ") and not line.startswith("| mode")]
    assert modes == ["llamacpp_plain", "plain"]


def test_partial_records_give_no_decode_rate_and_no_ratio_for_an_unpaired_category():
    """One row without its prompt pass: no decode tok/s for the group (not the others' median);
    a category whose prompts have no plain reference gets no ×plain entry (the others still do)."""
    rows = [{**_spec("a", 100.0), "prefill_s": 0.01}, _spec("b", 100.0)]
    assert report.aggregate(rows)[0].decode_tokens_per_s_median is None
    rows = [_engine("plain", "plain", "a", 50.0), _spec("a", 100.0), _spec("b", 100.0, cat="chat")]
    spec = next(g for g in report.aggregate(rows) if g.mode == "speculative")
    assert spec.speedup_by_category == {"code": pytest.approx(2.0)}


def test_a_draft_temperature_factor_of_one_is_not_mentioned():
    """Rows that record factor 1.0 (the default) at T > 0 sampled the draft at T: nothing to say."""
    assert report._draft_temperature([{"draft_temperature_factor": 1.0, "temperature": 1.0}]) == ""
    assert report._draft_temperature([{"draft_temperature_factor": 0.85, "temperature": 1.0}]) == ", sampled at 0.85 × T"


def test_a_prompt_file_saved_with_a_byte_order_mark_reads(tmp_path):
    """Editors on Windows write UTF-8 with a BOM: the first line still reads as JSON."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "x", "id": "a"}\n', encoding="utf-8-sig")
    assert [(p.id, p.text) for p in load_jsonl(f)] == [("a", "x")]


@pytest.mark.parametrize("text, says", [
    ('{"prompt": "   "}', "each line needs a non-empty string field 'prompt'"),  # a blank prompt is no prompt
    ('{"prompt": "a", "id": true}', "'id' must be a string, got true"),  # a JSON boolean is not an id
    ('{"prompt": "a", "category": false}', "'category' must be a string, got false"),
])
def test_a_prompt_file_refuses_blank_prompts_and_boolean_ids(tmp_path, text, says):
    f = tmp_path / "p.jsonl"
    f.write_text(text + "\n")
    with pytest.raises(ConfigError, match=f":1: {says}"):
        load_jsonl(f)


def test_numeric_ids_and_categories_are_read_as_strings(tmp_path):
    """An id or category written as a JSON number is kept, as its text (rows pair by the string)."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "id": 7, "category": 3}\n')
    assert [(p.id, p.category) for p in load_jsonl(f)] == [("7", "3")]


def test_a_prompt_file_of_blank_lines_says_it_holds_no_prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n  \n")
    with pytest.raises(ConfigError, match="holds no prompts"):
        load_jsonl(f)


def test_limit_zero_keeps_no_prompt_rather_than_all():
    """--limit 0 keeps the first 0 prompts of each category: nothing is left (an error), not everything."""
    with pytest.raises(ConfigError, match="no prompts left"):
        select(BUILTIN, limit=0)


def test_the_early_chat_check_waits_where_the_files_cannot_tell(monkeypatch):
    """A target whose files cannot tell (chat_template_known is None: a hub id) is not refused
    before it loads; one whose files say False is."""
    from specdec.models import registry

    chat = [p for p in BUILTIN if p.chat][:1]
    monkeypatch.setattr(registry, "chat_template_known", lambda target: None)
    workloads.check_chat_files(chat, "org/model")  # checked later, once its tokenizer loads
    monkeypatch.setattr(registry, "chat_template_known", lambda target: False)
    with pytest.raises(ConfigError, match="has no chat template"):
        workloads.check_chat_files(chat, "org/model")


def test_a_mean_gamma_below_one_half_still_fits_alpha_at_gamma_one():
    """Mean γ 0.4 (4 drafted tokens over 10 calls) rounds to 0; the i.i.d. fit uses γ >= 1, so
    12 tokens / 10 calls = E(α, 1) = 1 + α gives α = 0.2 (γ 0 would give α 0 and ×1)."""
    rows = [_engine("plain", "plain", "a", 50.0, calls=20, gen=20, target_s=0.36),
            _spec("a", 60.0, calls=10, gen=12, prop=4, acc=2, draft_s=0.004)]
    g = next(g for g in report.aggregate(rows) if g.mode == "speculative")
    assert g.mean_gamma == pytest.approx(0.4)
    assert g.alpha_iid == pytest.approx(0.2, abs=1e-8)
    assert g.predicted_speedup_iid == pytest.approx(theory.speedup(0.2, 1, g.cost_ratio_c))


def test_generated_tokens_is_a_mean_over_the_groups_runs():
    """generated_tokens_mean is the mean (10, 10, 40 -> 20), not the median (10)."""
    rows = [_spec(p, 100.0, gen=n) for p, n in zip("abc", (10, 10, 40))]
    assert report.aggregate(rows)[0].generated_tokens_mean == pytest.approx(20.0)


def test_a_position_nobody_drafted_has_no_acceptance_rather_than_zero():
    """Position 2 recorded with 0 drafted tokens in every row: no rate (NaN, shown "–"), not 0.00."""
    rows = [_spec("a", 100.0, per_pos=(0.5, 0.0), prop_pos=(10, 0)), _spec("b", 100.0, per_pos=(0.3, 0.0), prop_pos=(10, 0))]
    [g] = report.aggregate(rows)
    assert g.acceptance_per_position[0] == pytest.approx(0.4) and math.isnan(g.acceptance_per_position[1])
    row = next(line for line in report._local_tables([g], []) if line.startswith("| block | 4 | 0 | 0.40 |"))
    assert row.startswith("| block | 4 | 0 | 0.40 | – |")


def test_drafter_table_tokens_per_second_is_a_median():
    """The drafter table's tok/s is the median over the category's runs (10, 20, 90 -> 20), not the mean."""
    rows = [{**_spec(p, tps), "draft": "d"} for p, tps in zip("abc", (10.0, 20.0, 90.0))]
    [r] = report.drafters_by_category(rows)
    assert r.tokens_per_s_median == pytest.approx(20.0)


def test_only_speculative_groups_get_theory_columns():
    """An edge_only group that records drafted tokens gets engine metrics but no theory (α, c, ideal)."""
    rows = [_engine("plain", "plain", "a", 50.0, calls=20, gen=20, target_s=0.36),
            _engine("edge_only", "edge_only", "a", 80.0, calls=10, gen=20, prop=10, acc=5, draft_s=0.01)]
    g = next(g for g in report.aggregate(rows) if g.mode == "edge_only")
    assert g.draft_step_ms == pytest.approx(1.0)
    assert (g.alpha_iid, g.cost_ratio_c, g.ideal_speedup, g.optimal_gamma_iid) == (None, None, None, None)


def test_peak_rss_is_none_when_nothing_recorded_it():
    """No process record and no row with a peak: rss_peak_bytes is None (null in results.json), not 0."""
    rows = [_spec("a", 100.0), _spec("b", 100.0)]
    g = report.aggregate(rows)[0]
    assert g.rss_peak_bytes is None and g.kv_share_of_rss is None


def test_a_tree_floor_of_zero_is_still_named():
    """--tree-min-prob 0 is a floor the run used (it keeps every node): the header says so."""
    assert report._tree_floor({"gammas": ["tree-8"], "tree_min_prob": 0.0}) == ", tree probability floor 0"


def test_a_reference_that_generated_nothing_does_not_break_the_decode_ratio():
    """Prompt a's plain run generated no token (decode rate 0): no division by zero; the wall-clock
    speed-up is prompt b's alone."""
    rows = [{**_engine("plain", "plain", "a", 50.0), "generated_tokens": 0, "tokens_per_s": 0.0, "wall_s": 0.3, "prefill_s": 0.1},
            {**_engine("plain", "plain", "b", 50.0), "prefill_s": 0.1},
            {**_spec("a", 100.0), "prefill_s": 0.1}, {**_spec("b", 100.0), "prefill_s": 0.1}]
    g = next(g for g in report.aggregate(rows) if g.mode == "speculative")
    assert g.speedup_vs_cloud == pytest.approx(2.0)
    assert g.speedup_decode is None or g.speedup_decode > 0


def test_results_json_is_written_before_the_plots(tmp_path, monkeypatch):
    """A run stopped (or failing) while plotting still leaves a whole results.json for --report-only."""
    def broken(*args, **kwargs):
        raise RuntimeError("plotting failed")

    monkeypatch.setattr(report, "plot", broken)
    with pytest.raises(RuntimeError, match="plotting failed"):
        report.write({"config": _cfg(), "samples": _samples(), "processes": {}, "machine": {}}, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["groups"] and saved["samples"]


def test_write_saves_old_results_under_todays_mode_names(tmp_path):
    """An old result's cloud_only rows are saved as plain ones (and pair as such in the tables)."""
    old = [{**s, "mode": "cloud_only", "method": "cloud_only"} if s["mode"] == "plain" else s for s in _samples()]
    report.write({"config": _cfg(), "samples": old, "processes": {}, "machine": {}}, tmp_path, make_plots=False)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert {s["mode"] for s in saved["samples"]} == {"plain", "hf_assisted", "speculative"}
    assert all(s["method"] != "cloud_only" for s in saved["samples"])


def test_seeded_identity_lists_rows_by_temperature_first():
    """The seeded-identity table is ordered by T, then row label (as the other tables are)."""
    rows = []
    for t in (0.5, 1.0):
        rows.append({**_engine(report.PAIRED_COUPLED, report.PAIRED_COUPLED, "a", 40.0, t=t), "tokens_sha1": "s"})
        for d in ("b-drafter", "a-drafter"):
            rows.append({**_spec("a", 60.0, t=t), "method": "coupled", "draft": d, "tokens_sha1": "s"})
    assert [(label.split("· ")[1].split(" ")[0], t) for label, t, _, _ in report.seeded_identity(rows)] == [
        ("a-drafter", 0.5), ("b-drafter", 0.5), ("a-drafter", 1.0), ("b-drafter", 1.0)]


def test_the_optimal_gamma_is_searched_over_the_full_default_range():
    """optimal γ (iid) searches [0, 16] whatever γ the run drafted: at 4 tokens per call with γ 4
    (α ≈ 0.87) and c = 1/18 it lies above 4."""
    rows = [_engine("plain", "plain", "a", 50.0, calls=20, gen=20, target_s=0.36),
            _spec("a", 100.0, calls=10, gen=40, prop=40, acc=30)]
    g = next(g for g in report.aggregate(rows) if g.mode == "speculative")
    assert g.optimal_gamma_iid == theory.optimal_gamma(g.alpha_iid, g.cost_ratio_c, max_gamma=16)
    assert g.optimal_gamma_iid > 4


def test_kv_share_of_rss_is_given_for_every_engine_group():
    """Plain decoding's KV cache over its process's peak RSS is reported too, not only speculative's."""
    rows = [_engine("plain", "plain", "a", 50.0)]
    [g] = report.aggregate(rows, {"plain": {"rss_peak_bytes": 4000}})
    assert g.kv_share_of_rss == pytest.approx(0.25)


def test_no_llamacpp_section_without_llamacpp_plain():
    """The "Against llama.cpp" table compares with llama.cpp plain decoding: without it, no table."""
    from .test_llamacpp_rows import _row

    assert report._llamacpp_table(report.aggregate([_row("llamacpp_spec", "a", 150.0), _engine("plain", "plain", "a", 50.0)])) == []


def test_greedy_identity_leaves_out_every_plain_mode():
    """plain_paired_coupled rows at T = 0 are plain decoding too: not rows to check against plain."""
    rows = [{"mode": "plain_paired", "temperature": 0, "prompt_id": "a", "seed": 0, "tokens_sha1": "x"},
            {"mode": report.PAIRED_COUPLED, "method": report.PAIRED_COUPLED, "temperature": 0, "prompt_id": "a", "seed": 0, "tokens_sha1": "x"},
            {"mode": "speculative", "method": "greedy", "gamma": "4", "temperature": 0, "prompt_id": "a", "seed": 0, "tokens_sha1": "x"}]
    assert report.greedy_identity(rows) == [("speculative greedy γ=4", 1, 1)]


def test_machine_line_of_a_result_that_recorded_no_machine():
    assert report.machine_line({}) == "?, ? cores, torch ?"


def test_draft_share_is_draft_time_over_wall_time():
    """draft share = Σ draft_s / Σ wall_s (what the summary's "draft / target share" shows), not a
    share of the model time alone: 0.04 s of drafting in a 0.2 s run is 20%."""
    [g] = report.aggregate([_spec("a", 100.0), _spec("b", 100.0)])
    assert g.draft_share == pytest.approx(0.2)


def test_a_prompt_pass_timed_at_zero_still_gives_a_decode_rate():
    """prefill_s = 0.0 is recorded (a pass too short for the clock): decode tok/s = tokens / wall, not None."""
    row = {**_spec("a", 100.0), "prefill_s": 0.0}
    assert report._decode_tps(row) == pytest.approx(100.0)


def test_decode_speedup_uses_the_same_reference_as_the_wall_clock_speedup():
    """With plain_paired present, ×plain and decode × both compare with plain_paired (decoding at
    25 tok/s here), not with plain (50 tok/s, minutes apart): 100 / 25 = 4 for both."""
    rows = []
    for mode, tps in (("plain", 50.0), ("plain_paired", 25.0), ("speculative", 100.0)):
        row = _spec("a", tps) if mode == "speculative" else _engine(mode, mode, "a", tps)
        rows.append({**row, "wall_s": 0.1 + 20 / tps, "prefill_s": 0.1})
    g = next(g for g in report.aggregate(rows) if g.mode == "speculative")
    assert g.speedup_decode == pytest.approx(4.0)


def test_a_group_that_generated_nothing_has_no_calls_per_token():
    """Runs that stopped at once (0 tokens, the prompt's target call made): no cloud calls/token, no crash."""
    [g] = report.aggregate([{**_spec("a", 100.0, gen=0, calls=1), "wall_s": 0.1}])
    assert g.cloud_calls_per_token is None
