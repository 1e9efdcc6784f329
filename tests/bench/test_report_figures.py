"""Report figures pinned on synthetic rows: pairing by temperature and seed, medians of even
counts, quantiles, pooled per-position acceptance, the accepted-tokens histogram, the theory
columns on rows that differ from prompt to prompt (synthetic samples, no timing)."""

import pytest

from specdec.bench import report, theory

from .test_report import _engine, _spec


def test_speedups_pair_with_the_plain_run_of_the_same_temperature_and_seed():
    rows = [
        # T = 0 plain at 50 tok/s, T = 1 plain at 25: a speculative row at 100 is x2 at T = 0, x4 at T = 1
        _engine("plain", "plain", "a", 50.0, t=0.0), _engine("plain", "plain", "a", 25.0, t=1.0),
        _spec("a", 100.0, t=0.0), _spec("a", 100.0, t=1.0),
        # T = 0.5, seeds 0 and 1 of prompt b: plain 50 and 20, speculative 100 each -> ratios 2 and 5, median 3.5
        _engine("plain", "plain", "b", 50.0, t=0.5, seed=0), _engine("plain", "plain", "b", 20.0, t=0.5, seed=1),
        _spec("b", 100.0, t=0.5, seed=0), _spec("b", 100.0, t=0.5, seed=1),
    ]
    spec = {g.temperature: g for g in report.aggregate(rows) if g.mode == "speculative"}
    assert spec[0.0].speedup_vs_cloud == pytest.approx(2.0)
    assert spec[1.0].speedup_vs_cloud == pytest.approx(4.0)
    assert spec[0.5].speedup_vs_cloud == pytest.approx(3.5)


def test_medians_of_an_even_count_average_the_two_middle_values():
    # two prompts, 20 tokens each, 0.1 s prompt pass: walls 0.3 and 0.5 s
    # tok/s 20/0.3 = 66.67 and 20/0.5 = 40 -> median 53.33; decode tok/s 20/0.2 = 100 and 20/0.4 = 50 -> median 75
    rows = [{**_spec(p, 20 / wall), "wall_s": wall, "prefill_s": 0.1} for p, wall in (("a", 0.3), ("b", 0.5))]
    [g] = report.aggregate(rows)
    assert g.tokens_per_s_median == pytest.approx((20 / 0.3 + 20 / 0.5) / 2)
    assert g.decode_tokens_per_s_median == pytest.approx(75.0)
    assert g.tokens_per_s_by_category == {"code": pytest.approx((20 / 0.3 + 20 / 0.5) / 2)}


def test_quantiles_interpolate_linearly():
    # tok/s 10, 20, 40, 80 (20 tokens: walls 2, 1, 0.5, 0.25 s)
    # q25: position 3 * 0.25 = 0.75 -> 10 + 0.75 * 10 = 17.5; q75: position 2.25 -> 40 + 0.25 * 40 = 50
    # walls sorted 0.25, 0.5, 1, 2: p50 at 1.5 -> 0.5 + 0.5 * 0.5 = 0.75; p95 at 2.85 -> 1 + 0.85 * 1 = 1.85
    rows = [_spec(p, tps) for p, tps in zip("abcd", (10.0, 20.0, 40.0, 80.0))]
    [g] = report.aggregate(rows)
    assert g.tokens_per_s_q25 == pytest.approx(17.5) and g.tokens_per_s_q75 == pytest.approx(50.0)
    assert g.latency_p50_s == pytest.approx(0.75) and g.latency_p95_s == pytest.approx(1.85)


def test_acceptance_per_position_pools_the_drafted_tokens_of_every_prompt():
    # position 1: prompt a accepts 10 of 10, prompt b 6 of 30 -> 16 / 40 = 0.4 (not (1.0 + 0.2) / 2)
    # position 2: prompt a 2 of 4, prompt b drafted none there -> 2 / 4 = 0.5
    rows = [_spec("a", 100.0, per_pos=(1.0, 0.5), prop_pos=(10, 4), draft="d"),
            _spec("b", 100.0, per_pos=(0.2, 0.0), prop_pos=(30, 0), draft="d")]
    [g] = report.aggregate(rows)
    assert g.acceptance_per_position == pytest.approx([0.4, 0.5])
    [r] = report.drafters_by_category(rows)
    assert r.acceptance_per_position == pytest.approx([0.4, 0.5])


def test_accepted_histogram_sums_rounds_by_accepted_tokens_and_renders_shares():
    # rounds with 0, 1, 2 accepted tokens: [3, 1] + [1, 0, 2] = [4, 1, 2], 7 rounds: shares 0.57, 0.14, 0.29
    rows = [_spec("a", 100.0, accepted_histogram=[3, 1]), _spec("b", 100.0, accepted_histogram=[1, 0, 2])]
    stats = report.aggregate(rows)
    assert stats[0].accepted_histogram == [4, 1, 2]
    lines = report._local_tables(stats, [])
    i = lines.index("| method | γ | T | tokens/call | 0 | 1 | 2 |")
    assert lines[i + 2] == "| block | 4 | 0 | 2.00 | 0.57 | 0.14 | 0.29 |"


def _theory_rows():
    """Plain: 20 tokens in 20 calls, 2.0 s of target time each (0.1 s a step), wall 2.5 s of which
    0.5 s prompt pass (tok/s 8, decode tok/s 10).  Speculative, prompts unlike each other:
    a: 10 tokens / 8 calls, 29 drafted, wall 1.5 s (tok/s 6.667, decode 10 / 1.0 = 10);
    b: 52 tokens / 24 calls, 87 drafted, wall 2.5 s (tok/s 20.8, decode 52 / 2.0 = 26)."""
    rows = []
    for p in "ab":
        rows.append({**_engine("plain", "plain", p, 8.0, gen=20, calls=20, target_s=2.0), "wall_s": 2.5, "prefill_s": 0.5})
    for p, gen, calls, prop, wall in (("a", 10, 8, 29, 1.5), ("b", 52, 24, 87, 2.5)):
        rows.append({**_spec(p, gen / wall, gen=gen, calls=calls, prop=prop, acc=0, draft_s=prop * 1e-3, target_s=calls * 0.02,
                             gamma="auto"), "wall_s": wall, "prefill_s": 0.5})
    return rows


def test_theory_columns_use_the_groups_pooled_tokens_per_call_and_rounded_mean_gamma():
    [g] = [g for g in report.aggregate(_theory_rows()) if g.mode == "speculative"]
    # pooled tokens/call 62 / 32 = 1.9375 = E(0.5, 4) = (1 - 0.5^5) / 0.5; mean γ 116 / 32 = 3.625 -> 4
    assert g.mean_gamma == pytest.approx(3.625)
    assert g.alpha_iid == pytest.approx(0.5, abs=1e-8)
    # draft step 116 ms / 116 = 1 ms, verify 0.64 s / 32 = 20 ms, plain step 4.0 s / 40 = 0.1 s: c = 0.01
    assert g.draft_step_ms == pytest.approx(1.0) and g.verify_ms == pytest.approx(20.0)
    assert g.cost_ratio_c == pytest.approx(0.01)
    assert g.predicted_speedup_iid == pytest.approx(1.9375 / (4 * 0.01 + 1))
    # ideal: 1.9375 tokens / (3.625 * 1 ms + 20 ms) = 82.0106 tok/s, x 0.1 s plain step = 8.20106
    assert g.ideal_speedup == pytest.approx(1.9375 / 0.023625 * 0.1)
    # decode ratios 10/10 = 1.0 and 26/10 = 2.6: median 1.8; wall ratios 6.667/8 and 20.8/8: median 1.71667
    assert g.speedup_decode == pytest.approx(1.8)
    assert g.speedup_vs_cloud == pytest.approx((10 / 1.5 / 8 + 2.6) / 2)
    assert g.efficiency == pytest.approx(1.8 / g.ideal_speedup)
    assert g.overhead_share == pytest.approx(1 - 1.8 / g.ideal_speedup)
    assert g.ideal_speedup == pytest.approx(theory.ideal_tokens_per_s(62 / 32, 3.625, 1e-3, 0.02) * 0.1)


def test_decode_speedup_is_none_when_any_row_lacks_its_prompt_pass():
    rows = _theory_rows()
    rows[-1] = {k: v for k, v in rows[-1].items() if k != "prefill_s"}  # prompt b's speculative row: not recorded
    [g] = [g for g in report.aggregate(rows) if g.mode == "speculative"]
    assert g.speedup_decode is None
    assert g.efficiency == pytest.approx(g.speedup_vs_cloud / g.ideal_speedup)  # falls back to the wall-clock ratio


def test_drafter_table_tokens_per_call_is_generated_over_calls_pooled():
    # one drafter, two prompts of one category: 10 / 8 and 52 / 24 -> 62 / 32 = 1.9375 (not their mean 1.708)
    rows = [{**r, "draft": "d"} for r in _theory_rows() if r["mode"] == "speculative"]
    [r] = report.drafters_by_category(rows + _theory_rows()[:2])
    assert r.tokens_per_call == pytest.approx(62 / 32)
    assert r.speedup == pytest.approx((10 / 1.5 / 8 + 2.6) / 2)


def test_greedy_identity_prefers_the_plain_run_of_the_same_process():
    rows = [
        {"mode": "plain", "temperature": 0, "prompt_id": "a", "seed": 0, "tokens_sha1": "x"},
        {"mode": "plain_paired", "temperature": 0, "prompt_id": "a", "seed": 0, "tokens_sha1": "y"},
        {"mode": "speculative", "method": "greedy", "gamma": "auto", "temperature": 0, "prompt_id": "a", "seed": 0, "tokens_sha1": "y"},
    ]
    assert report.greedy_identity(rows) == [("speculative greedy γ=auto", 1, 1)]
