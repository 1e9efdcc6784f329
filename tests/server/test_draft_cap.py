"""The batching server's draft cap: the rule (pure), its estimates, and that a capped round is lossless."""

from __future__ import annotations

import random

import pytest
from fastapi.testclient import TestClient

from specdec.models.toy import ToyLM
from specdec.remote.protocol import VerifyRequest
from specdec.server import ServerSettings, create_app
from specdec.server.draft_cap import CapConfig, DraftCap, RowCosts, cap_from, row_costs
from toy_server import FixedCap

VOCAB = 8


def test_cap_counts_leading_positions_above_the_threshold():
    assert cap_from([0.5, 0.3, 0.1, 0.4], 0.25) == 2  # stops at the first position below
    assert cap_from([0.5, 0.3], 0.6) == 0
    assert cap_from([0.9, 0.8], 0.0) == 2
    assert cap_from([0.5, 0.25, 0.4], 0.25) == 1  # a position at the threshold exactly does not pay


def test_row_costs_fit_a_line_and_refuse_a_constant_batch():
    rows = [5, 20, 60, 140, 90]
    a, b = row_costs(rows, [0.012 + 0.0017 * r for r in rows])
    assert a == pytest.approx(0.012) and b == pytest.approx(0.0017)
    assert row_costs([8, 8, 8], [0.1, 0.2, 0.15]) is None


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _loaded(tokens_per_row: float, p: list[float], costs=None) -> DraftCap:
    """A cap fed 32 compute-bound passes (a = 12 ms, b = 1.7 ms per row) and 400 rounds of γ = 4."""
    clock = _Clock()
    cap = DraftCap(CapConfig(window_s=100.0, min_passes=16, min_rounds=32, max_positions=6), clock=clock, costs=costs)
    rng = random.Random(0)
    for i in range(32):
        clock.t += 0.3
        rows = rng.randint(60, 160)
        cap.observe_pass(rows, 0.012 + 0.0017 * rows)
        cap.observe_tokens(round(rows * tokens_per_row))
    for i in range(400):  # rounds of γ = 4 whose acceptance per position follows p
        accepted = 0
        while accepted < 4 and rng.random() < p[accepted] / (p[accepted - 1] if accepted else 1.0):
            accepted += 1
        cap.observe_round("greedy", 4, accepted)
    return cap


def test_the_cap_follows_acceptance_and_load():
    """threshold = m ρ with m ≈ 0.85-0.95 here: acceptance 0.46 / 0.27 / 0.16 / 0.11 per position
    (the load test's greedy edges) gives cap 2 at 0.25 tokens per row, 0 at 0.6, and at 0.05 none
    of the four drafted positions is cut (nor positions 5 and 6, never drafted: 6)."""
    p = [0.46, 0.27, 0.16, 0.11]
    assert _loaded(0.25, p).cap("greedy") == 2
    assert _loaded(0.05, p).cap("greedy") == 6
    assert _loaded(0.6, p).cap("greedy") == 0
    assert _loaded(0.25, p).cap("coupled") is None  # no rounds of that wire yet
    # costs measured at start-up replace the live fit: a pass that is mostly fixed cost (a = 1 s)
    # makes rows nearly free, so nothing is capped
    assert _loaded(0.25, p, costs=(0.012, 0.0017)).cap("greedy") == 2
    assert _loaded(0.25, p, costs=(1.0, 0.0017)).cap("greedy") == 6
    # a token coming sooner worth a quarter (a request's choice ahead of the slowest of four): four
    # times the threshold
    assert _loaded(0.05, p).cap("greedy", value=0.25) == 2  # threshold ~0.047 -> ~0.19
    assert _loaded(0.25, p).cap("greedy", value=0.25) == 0  # ~0.23 -> ~0.94


def test_calibration_times_the_model_alone():
    """A cost curve over the row counts asked for (one sequence up to 8 rows, sequences of 8
    beyond), its times never falling with rows."""
    from specdec.server.draft_cap import calibrate
    from tiny import tiny_native

    curve = calibrate(tiny_native(), rows=(1, 2, 4, 24), reps=1)
    assert curve.rows == (1, 2, 4, 24) and curve.seconds[0] > 0
    assert all(b >= a for a, b in zip(curve.seconds, curve.seconds[1:]))
    assert calibrate(ToyLM(VOCAB, order=1, seed=0)) is None  # no batched forward: the live fit is used
    # a model of a 64-token context (the first version prefilled 64 tokens and crashed the server's start)
    short = calibrate(tiny_native(max_length=64), rows=(1, 2, 24), reps=1)
    assert short is not None and short.rows == (1, 2, 24)
    assert calibrate(tiny_native(max_length=8), rows=(1, 2), reps=1) is None  # no room for a sequence's rows


def test_calibration_prefills_once_and_times_long_passes_fewer_times():
    """One prefill for all the sequences (the rest copy its cache), ``reps`` passes per row count
    while they fit ``budget_s``, and at least one however long a pass takes."""
    from specdec.server.draft_cap import calibrate
    from tiny import tiny_native

    model = tiny_native()
    prefills, passes = [], []
    forward, forward_batch = model.forward, model.forward_batch
    model.forward = lambda ids, cache, **kw: prefills.append(len(ids)) or forward(ids, cache, **kw)
    model.forward_batch = lambda items: passes.append(sum(len(i[0]) for i in items)) or forward_batch(items)
    rows = (1, 4, 24)
    calibrate(model, rows=rows, reps=3, budget_s=1e9)
    assert prefills == [64] and passes == [1, 1, 1, 4, 4, 4, 24, 24, 24]
    prefills.clear()
    passes.clear()
    calibrate(model, rows=rows, reps=3, budget_s=0.0)
    assert prefills == [64] and passes == [1, 4, 24]


def test_a_cost_curve_reads_each_rows_own_marginal_cost():
    """Rows nearly free at two to four and dear at a hundred (as on a 2-core CPU): the slope at a
    single user's ~2 rows per pass is the small one, and there the threshold m ρ is far below the
    one a straight line through the curve's ends gives; a loaded server's ~100 rows read the steep
    piece.  Timings that fall with rows (noise) are raised to the smaller row count's."""
    curve = RowCosts.measured((1, 2, 4, 8, 96), (0.0027, 0.00285, 0.0028, 0.0045, 0.047))
    assert curve.seconds == (0.0027, 0.00285, 0.00285, 0.0045, 0.047)
    assert curve.slope(1.5) == pytest.approx(0.00015) and curve.slope(3) == 0.0
    assert curve.slope(50) == pytest.approx((0.047 - 0.0045) / 88) and curve.slope(200) == curve.slope(50)
    assert curve.at(6) == pytest.approx(0.00285 + 2 * (0.0045 - 0.00285) / 4) and curve.at(0.5) == pytest.approx(0.002625)
    line = RowCosts.line(0.0027 - (0.047 - 0.0027) / 95, (0.047 - 0.0027) / 95)
    assert line.at(96) == pytest.approx(0.047) and line.slope(2) == pytest.approx((0.047 - 0.0027) / 95)

    def threshold(costs, rows: int) -> float:
        clock = _Clock()
        cap = DraftCap(CapConfig(window_s=1e9, min_passes=1, min_rounds=1), clock=clock, costs=costs)
        cap.observe_pass(rows, costs.at(rows))
        cap.observe_tokens(rows // 2)
        cap.observe_round("greedy", 2, 1)
        return cap.estimate("greedy")[0]

    assert threshold(curve, 2) < 0.1 * threshold(line, 2)  # a single user: rows nearly free
    assert threshold(curve, 96) == pytest.approx(threshold(line, 96), rel=0.1)  # a busy server: alike
    for rows in ((4, 2), (2, 2, 4)):  # falling, or a row count twice (a piece of zero width)
        with pytest.raises(ValueError):
            RowCosts(rows, (0.1, 0.2, 0.3)[: len(rows)])


def test_positions_never_drafted_are_not_cut_and_cut_ones_are_probed():
    """A wire whose first rounds drafted one token, accepted, has no estimate past position 1:
    those positions are not cut (counted as 0 they cut every later round to one token, for good).
    A position the cap cuts is offered again every probe_every-th cap, so its estimate can recover:
    here position 2 is rejected in every early round, then accepted in every probe, until it pays."""
    cap = DraftCap(CapConfig(window_s=1e9, min_passes=1, min_rounds=1, max_positions=4, probe_every=4),
                   costs=(0.002, 0.001))
    for _ in range(10):
        cap.observe_pass(3, 0.005)
        cap.observe_tokens(2)
    cap.observe_round("greedy", 1, 1)
    assert cap.estimate("greedy")[1] == [1.0, None, None, None] and cap.cap("greedy") == 4
    for _ in range(50):
        cap.observe_round("greedy", 2, 1)  # position 2 never kept
    caps = []
    for _ in range(400):
        k = cap.cap("greedy")
        caps.append(k)
        cap.observe_round("greedy", min(k, 2), min(k, 2))  # drafts as far as allowed, all kept now
    assert caps[:3] == [1, 1, 2]  # cut at one; the wire's fourth cap (one was given above) probes position 2
    assert caps[-1] == 4  # position 2's estimate recovered: nothing cut


def test_a_cap_that_does_not_bind_is_not_counted_towards_a_probe():
    """A round that wants no more than the cap allows (``wanted``) leaves the probe count alone, so
    the probe lands on a round that would draft past the cut (counted, probes often fell on rounds
    that wanted one token anyway)."""
    cap = DraftCap(CapConfig(window_s=1e9, min_passes=1, min_rounds=1, max_positions=4, probe_every=4),
                   costs=(0.002, 0.001))
    for _ in range(10):
        cap.observe_pass(3, 0.005)
        cap.observe_tokens(2)
    for _ in range(50):
        cap.observe_round("greedy", 2, 1)  # position 2 never kept: cut at one
    got = []
    for _ in range(3):  # three binding caps, each between rounds that want one token
        got.append(cap.cap("greedy", wanted=3))
        got += [cap.cap("greedy", wanted=1) for _ in range(5)]
    assert got[0] == 1 and set(got[1:6]) == {1}
    assert cap.cap("greedy", wanted=3) == 2  # the fourth binding cap probes position 2
    assert cap.cap("greedy", wanted=3) == 1


def test_a_probe_never_asks_past_the_longest_tracked_position():
    """A wire that no position cuts is capped at ``max_positions``, probes included (a probe is one
    position past the cut, and there is no position past the last one)."""
    cap = DraftCap(CapConfig(window_s=1e9, min_passes=1, min_rounds=1, max_positions=3, probe_every=1),
                   costs=(0.002, 0.001))
    cap.observe_pass(3, 0.005)
    cap.observe_tokens(2)
    cap.observe_round("greedy", 3, 3)
    assert [cap.cap("greedy") for _ in range(3)] == [3, 3, 3]


def test_the_marginal_share_of_a_row_is_at_most_one():
    """m = b / (T / R) is clamped to [0, 1]: a fitted line with a negative intercept (noise at
    small row counts) would read one more row as dearer than an average one."""
    cap = DraftCap(CapConfig(window_s=1e9, min_passes=1, min_rounds=1), costs=(-0.01, 0.002))
    cap.observe_pass(10, 0.01)  # the line: 0.01 s at 10 rows, slope 0.002: m = 0.02 / 0.01 = 2
    cap.observe_tokens(4)
    cap.observe_round("greedy", 2, 1)
    assert cap.estimate("greedy")[0] == pytest.approx(4 / 10)  # m ρ with m = 1


def test_no_cap_before_enough_passes():
    cap = DraftCap(CapConfig(min_passes=16, min_rounds=1))
    cap.observe_round("greedy", 4, 0)
    cap.observe_tokens(10)
    for rows in (10, 20, 30):
        cap.observe_pass(rows, 0.01 * rows)
    assert cap.cap("greedy") is None


def _app(**settings):
    return create_app(ToyLM(VOCAB, order=2, seed=3), settings=ServerSettings(**settings))


def _pair(client: TestClient, app, wire: str, temperature: float):
    body = {"prompt_ids": [1, 2, 3], "temperature": temperature, "seed": 7, "wire": wire}
    ids = [client.post("/v1/sessions", json=body).json()["session_id"] for _ in range(2)]
    return [app.state.ctx.store.get(i) for i in ids]


def _q(tokens: list[int], rng: random.Random) -> list[dict]:
    rows = []
    for t in tokens:
        other = (t + 1 + rng.randrange(VOCAB - 1)) % VOCAB
        w = rng.uniform(0.2, 0.9)
        rows.append({"ids": [t, other], "probs": [w, 1 - w]})
    return rows


@pytest.mark.parametrize("wire,temperature", [("greedy", 0.0), ("coupled", 1.0), ("sparse-q", 1.0)])
def test_a_capped_round_is_the_round_of_the_shorter_draft(wire, temperature):
    """30 rounds of random 5-token drafts: a session capped to k (random per round) answers
    exactly what a twin session answers to the first k tokens sent as the draft (same tokens,
    same acceptance; generators in step), for greedy, coupled and block verification (the server
    caps only the first two, but truncation itself is the shorter draft's round for all)."""
    app = _app()
    client = TestClient(app, base_url="http://localhost")
    capped, direct = _pair(client, app, wire, temperature)
    settings = app.state.ctx.settings
    rng = random.Random(wire)
    truncated = 0
    for seq in range(30):
        tokens = [rng.randrange(VOCAB) for _ in range(5)]
        k = rng.randrange(0, 6)
        q = _q(tokens, rng) if wire == "sparse-q" else None
        with capped.lock:
            a = capped.verify(VerifyRequest(seq=seq, draft_tokens=tokens, q=q), settings, draft_cap=k)
        with direct.lock:
            b = direct.verify(VerifyRequest(seq=seq, draft_tokens=tokens[:k], q=None if q is None else q[:k]), settings)
        assert (a.tokens, a.num_accepted, a.metrics.gamma) == (b.tokens, b.num_accepted, b.metrics.gamma)
        assert a.metrics.capped_from == (5 if k < 5 else None)
        truncated += k < 5
    assert truncated > 10
    assert capped.target.context.tolist() == direct.target.context.tolist()


def test_the_verify_endpoint_applies_the_cap():
    app = _app()
    client = TestClient(app, base_url="http://localhost")
    sid = client.post("/v1/sessions", json={"prompt_ids": [1, 2], "temperature": 0.0}).json()["session_id"]
    assert app.state.ctx.draft_cap is not None  # on by default with batching
    app.state.ctx.draft_cap = FixedCap(1)
    r = client.post(f"/v1/sessions/{sid}/verify", json={"seq": 0, "draft_tokens": [1, 2, 3, 4]}).json()
    assert r["metrics"]["gamma"] == 1 and r["metrics"]["capped_from"] == 4
    assert app.state.ctx.draft_cap.wanted == [4]  # the edge's draft length: a cap that binds counts for probes
    # block verification: a seed's sample depends on γ, so such rounds are never capped
    sid = client.post("/v1/sessions", json={"prompt_ids": [1, 2], "temperature": 1.0, "seed": 3,
                                             "wire": "sparse-q"}).json()["session_id"]
    q = [{"ids": [t], "probs": [1.0]} for t in (1, 2, 3, 4)]
    r = client.post(f"/v1/sessions/{sid}/verify", json={"seq": 0, "draft_tokens": [1, 2, 3, 4], "q": q}).json()
    assert r["metrics"]["gamma"] == 4 and r["metrics"]["capped_from"] is None


def test_no_cap_on_the_serialised_server_or_when_switched_off():
    assert _app(batching=False).state.ctx.draft_cap is None
    assert _app(draft_cap=False).state.ctx.draft_cap is None


def _steady(draft_pass_s: float | None, draft_rows: int = 10) -> DraftCap:
    """32 target passes of 100 rows in 0.2 s (costs a = 20 ms, b = 1.8 ms: m = 0.9), 25 tokens each,
    32 draft passes of ``draft_rows`` rows in ``draft_pass_s`` seconds each, 400 greedy (edge) and
    openai (drafted by the server: 1,200 tokens) rounds of γ = 3 with P(accepted >= k) = 0.8 / 0.5 / 0.3."""
    clock = _Clock()
    cap = DraftCap(CapConfig(window_s=1000.0, min_passes=16, min_rounds=32, max_positions=6), clock=clock,
                   costs=(0.020, 0.0018))
    for _ in range(32):
        clock.t += 0.3
        cap.observe_pass(100, 0.2)
        cap.observe_tokens(25)
        if draft_pass_s is not None:
            cap.observe_draft_pass(draft_rows, draft_pass_s)
    for i in range(400):
        accepted = (3 if i % 10 < 3 else 2 if i % 10 < 5 else 1 if i % 10 < 8 else 0)  # P(>=k) = .8 / .5 / .3
        cap.observe_round("greedy", 3, accepted)
        cap.observe_round("openai", 3, accepted, server_drafted=True)
    return cap


def test_the_servers_own_drafting_counts_its_draft_cost():
    """Edge drafts cost the server a target row: threshold m ρ = 0.9 × 0.25 = 0.225, so all three
    positions pay (and 4-6, never drafted, are not cut: 6).  Drafts the server makes itself cost the draft's passes too: 32 passes of
    0.1875 s for 1,200 drafted tokens are 5 ms a token, (0.9 × 0.2/100 + 0.005) × 800 tokens /
    (6.4 + 6.0) s = 0.44, so the first two do; at twice the draft seconds (0.51) only the first."""
    cap = _steady(0.1875)
    edge, p = cap.estimate("greedy")
    assert edge == pytest.approx(0.225) and p[:3] == pytest.approx([0.8, 0.5, 0.3], abs=0.01)
    own, _ = cap.estimate("openai", server_drafted=True)
    assert own == pytest.approx((0.9 * 0.002 + 0.005) * 800 / 12.4)
    assert cap.cap("greedy") == 6 and cap.cap("openai", server_drafted=True) == 2
    assert _steady(0.375).cap("openai", server_drafted=True) == 1
    assert _steady(None).cap("openai", server_drafted=True) is None  # no draft pass seen: no basis for a cap


def test_the_drafts_prefill_and_catch_up_rows_count_per_drafted_token():
    """What drafting costs is the draft's seconds per token it drafted, whatever rows its passes
    held: the same seconds over 10 or 1,000 rows a pass (a pass that is mostly a prompt's prefill,
    or the catch-up over what a sequence committed while not drafting) give the same threshold, and
    more seconds for the same drafted tokens a higher one."""
    few, many = _steady(0.1875, draft_rows=10), _steady(0.1875, draft_rows=1000)
    assert few.estimate("openai", server_drafted=True)[0] == pytest.approx(many.estimate("openai", server_drafted=True)[0])
    assert _steady(0.375, draft_rows=1000).estimate("openai", server_drafted=True)[0] > many.estimate("openai", server_drafted=True)[0]


def test_tree_rounds_count_their_drafted_nodes():
    """Token trees' draft passes land in T_d like any other; their nodes must land in D, or the
    server's chains are charged for them.  On the steady server above, as many more draft seconds
    (32 passes of 0.1875 s) for 1,200 tree nodes keep 5 ms a drafted token: (0.9 × 0.2/100 + 0.005)
    × 800 / (6.4 + 12.0) s = 0.296: all three drafted positions pay (the cap 6: 4-6 were never drafted).  Uncounted, the same seconds read as 10 ms a
    token (threshold 0.513) and the chains' cap falls to one position — what a served benchmark
    with tree requests beside chain requests showed (chains 2.03 → 1.54 tokens per call)."""
    counted, uncounted = _steady(0.1875), _steady(0.1875)
    for cap in (counted, uncounted):
        for _ in range(32):
            cap.observe_draft_pass(10, 0.1875)
    counted.observe_drafted(1200)
    assert counted.estimate("openai", server_drafted=True)[0] == pytest.approx((0.9 * 0.002 + 0.005) * 800 / 18.4)
    assert uncounted.estimate("openai", server_drafted=True)[0] == pytest.approx((0.9 * 0.002 + 0.010) * 800 / 18.4)
    assert counted.cap("openai", server_drafted=True) == 6 and uncounted.cap("openai", server_drafted=True) == 1


def test_openai_tree_requests_report_their_drafted_nodes():
    """A served tree request tells the cap how many nodes its rounds drafted (chain rounds are
    reported as rounds instead), and answers what a chain answers (greedy)."""
    from specdec.drafters import ModelDrafter
    from toy_server import LetterTokenizer

    texts = {}
    for tree in (4, "chain"):
        target = ToyLM(VOCAB, order=2, seed=3)
        draft = target.perturbed(0.3, seed=1)
        app = create_app(target, tokenizer=LetterTokenizer(), settings=ServerSettings(),
                         drafter_factory=lambda: ModelDrafter(draft), drafter_name="toy")
        app.state.ctx.draft_cap = fixed = FixedCap(8)
        client = TestClient(app, base_url="http://localhost")
        r = client.post("/v1/completions", json={"prompt": "abcab", "max_tokens": 24, "temperature": 0, "tree": tree})
        assert r.status_code == 200, r.text
        texts[tree] = r.json()["choices"][0]["text"]
        stats = r.json()["specdec"]
        if tree == 4:
            assert stats["tree_rounds"] > 0 and sum(fixed.drafted) == stats["draft_tokens_proposed"] > 0
            assert fixed.rounds == []  # no chain estimate learns from a tree's rounds
        else:
            assert fixed.drafted == [] and fixed.rounds
    assert texts[4] == texts["chain"]


def test_the_window_forgets_what_it_trims():
    """The running sums follow the window: passes older than it leave the fit, the draft's cost per
    drafted token is kept once nothing is left to measure it by."""
    clock = _Clock()
    cap = DraftCap(CapConfig(window_s=10.0, min_passes=2, min_rounds=1, max_positions=4), clock=clock)
    for rows in (10, 30):  # old passes: 1 ms a row
        cap.observe_pass(rows, 0.001 * rows)
    cap.observe_tokens(20)
    cap.observe_draft_pass(5, 0.05)
    cap.observe_round("openai", 2, 1, server_drafted=True)
    old, _ = cap.estimate("openai", server_drafted=True)
    clock.t = 11.0
    for rows in (10, 30):  # new passes: 2 ms a row plus 10 ms
        cap.observe_pass(rows, 0.01 + 0.002 * rows)
    cap.observe_tokens(20)
    assert cap._passes.sums == [40, pytest.approx(0.1), 1000, pytest.approx(10 * 0.03 + 30 * 0.07)]
    assert cap._draft_passes.sums == [0] and cap._drafted.sums == [0]
    from specdec.server.draft_cap import fit_line
    assert fit_line(len(cap._passes), *cap._passes.sums) == pytest.approx((0.01, 0.002))
    new, _ = cap.estimate("openai", server_drafted=True)
    # m = 0.04 / 0.05 = 0.8, T/R = 0.1 / 40, draft 0.05 s per drafted token (kept), E = 20
    assert new == pytest.approx((0.8 * 0.1 / 40 + 0.025) * 20 / 0.1) and new != old


def test_a_window_emptied_by_the_trim_sums_to_exact_zeros():
    """Float sums that lose every entry are set back to 0 rather than left at the rounding residue
    of adding and removing them (0.1 + 0.2 - 0.1 - 0.2 is 2.8e-17, not 0)."""
    from specdec.server.draft_cap import _Window

    window = _Window(1)
    window.add(0.0, 0.1)
    window.add(0.0, 0.2)
    window.trim(1.0)
    assert len(window) == 0 and window.sums == [0]
    window.add(2.0, 0.3)
    assert window.sums == [0.3]


def test_a_pass_exactly_the_window_old_still_counts():
    """The window is closed at its far end: a pass ``window_s`` old stays in the fit, one any older
    leaves it."""
    clock = _Clock()
    cap = DraftCap(CapConfig(window_s=10.0, min_passes=2, min_rounds=1), clock=clock)
    cap.observe_pass(10, 0.01)
    clock.t = 10.0
    cap.observe_pass(30, 0.03)
    assert len(cap._passes) == 2 and cap._passes.sums[0] == 40
    clock.t = 10.5
    cap.observe_pass(20, 0.02)
    assert len(cap._passes) == 2 and cap._passes.sums[0] == 50


def test_capped_gamma_takes_the_ceiling_and_reports_rounds():
    from specdec.gamma import CappedGamma, FixedGamma

    ceiling = [None]
    seen, wanted = [], []
    g = CappedGamma(FixedGamma(4), cap=lambda w: wanted.append(w) or ceiling[0],
                    observe=lambda gamma, acc: seen.append((gamma, acc)))
    assert g.next_gamma() == 4 and g.name == "fixed(4)" and wanted == [4]  # the cap is told what the round wants
    ceiling[0] = 2
    assert g.next_gamma() == 2
    ceiling[0] = 0
    assert g.next_gamma() == 0
    g.update(gamma=2, accepted=1, draft_s=0.0, target_s=0.0, other_s=0.0)
    assert seen == [(2, 1)]


def _openai_proposed(client: TestClient) -> float:
    """Draft tokens the server's own drafting proposed so far (its Prometheus counter)."""
    return sum(float(line.split()[-1]) for line in client.get("/metrics").text.splitlines()
               if line.startswith('specdec_draft_tokens_proposed_total{wire="openai"}'))


@pytest.mark.parametrize("k", [0, 1])
def test_openai_requests_draft_no_more_than_the_cap_and_give_the_same_text(k):
    """A greedy completion on a batching server whose cap says k drafts at most k tokens a round,
    reports its rounds to the cap, and returns the text an uncapped server returns."""
    from specdec.drafters import ModelDrafter
    from toy_server import LetterTokenizer

    texts = {}
    for capped in (True, False):
        target = ToyLM(VOCAB, order=2, seed=3)
        draft = target.perturbed(0.3, seed=1)
        app = create_app(target, tokenizer=LetterTokenizer(), settings=ServerSettings(),
                         drafter_factory=lambda: ModelDrafter(draft), drafter_name="toy")
        fixed = FixedCap(k) if capped else None
        app.state.ctx.draft_cap = fixed
        client = TestClient(app, base_url="http://localhost")
        r = client.post("/v1/completions", json={"prompt": "abcab", "max_tokens": 24, "temperature": 0, "gamma": 4})
        assert r.status_code == 200, r.text
        texts[capped] = r.json()["choices"][0]["text"]
        proposed = _openai_proposed(client)
        if capped:
            assert fixed.asked and set(fixed.asked) == {("openai-greedy", True)}  # acceptance is per rule
            assert set(fixed.wanted) == {4}  # each round tells the cap what it wants (γ 4), for the probes
            assert all(gamma <= k for _, gamma, _ in fixed.rounds) and len(fixed.rounds) >= 24 // (k + 1) // 2
            assert proposed <= k * len(fixed.rounds)
        else:
            assert proposed > 0
    assert texts[True] == texts[False]


def _lookup_request(drafter_factory, name: str, cap) -> tuple[str, float]:
    """One greedy completion of a repetitive prompt on a toy server whose draft cap is ``cap``
    (None: no cap): its text and the draft tokens the server's drafting proposed."""
    from toy_server import LetterTokenizer

    app = create_app(ToyLM(VOCAB, order=2, seed=3), tokenizer=LetterTokenizer(), settings=ServerSettings(),
                     drafter_factory=drafter_factory, drafter_name=name)
    app.state.ctx.draft_cap = cap
    client = TestClient(app, base_url="http://localhost")
    r = client.post("/v1/completions", json={"prompt": "abcabcab", "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], _openai_proposed(client)


def test_a_busy_servers_cap_stops_prompt_lookup_too():
    """The default drafter's prompt lookup costs the busy pass a row per token as well: a server
    whose cap says 0 asks it for the lookup wire too (as an edge-like cost, no draft pass), and
    then drafts nothing at all, model or lookup, and returns the uncapped server's text."""
    from specdec.drafters import ModelDrafter
    from specdec.drafters.hybrid import LookupThenModel

    draft = ToyLM(VOCAB, order=2, seed=3).perturbed(0.3, seed=1)
    fixed = FixedCap(0)
    texts, proposed = {}, {}
    for cap in (fixed, None):
        texts[cap], proposed[cap] = _lookup_request(
            lambda: LookupThenModel(ModelDrafter(draft, lazy_prefill=True), min_ngram=1), "toy+lookup", cap)
    assert set(fixed.asked) == {("openai-greedy", True), ("openai-greedy+lookup", False)}
    assert texts[fixed] == texts[None]
    assert proposed[fixed] == 0 and proposed[None] > 0


def test_a_busy_servers_cap_stops_prompt_lookup_alone():
    """A server drafting with prompt lookup alone (``--draft ngram``) has no draft model whose
    passes the cap could cost: its rounds are free drafts (the lookup wire, a target row each), so
    a cap of 0 stops them, and a cap of 1 keeps every round to one token (they had gone uncapped)."""
    from specdec.drafters import NgramDrafter

    texts, proposed = {}, {}
    for k in (0, 1, None):
        fixed = FixedCap(k) if k is not None else None
        texts[k], proposed[k] = _lookup_request(lambda: NgramDrafter(max_ngram=3, min_ngram=1), "ngram", fixed)
        if fixed is not None:
            assert set(fixed.asked) == {("openai-greedy+lookup", False)}
            assert fixed.rounds and all(wire == "openai-greedy+lookup" for wire, *_ in fixed.rounds)
            assert all(gamma <= k for _, gamma, _ in fixed.rounds)
    assert texts[0] == texts[1] == texts[None]
    assert proposed[0] == 0 and proposed[1] > 0 and proposed[None] > 0  # (how many γ auto drafts uncapped depends on timings)


def test_request_pace_values_a_choice_ahead_of_the_slowest_at_one_in_k():
    from specdec.server.draft_cap import RequestPace

    pace = RequestPace(waiting=3)
    pace.start(0)
    pace.start(1)
    pace.add(0, 5)
    assert pace.value(0) == 1.0  # choice 2 still waits for a slot: finishing early starts it sooner
    pace.start(2)
    assert pace.waiting == 0
    assert [pace.value(i) for i in range(3)] == [1 / 3, 1.0, 1.0]  # 5 against 0 and 0
    pace.add(1, 5)
    pace.add(2, 4)
    assert [pace.value(i) for i in range(3)] == [1 / 3, 1 / 3, 1.0]  # level with each other, ahead of 2
    pace.add(2, 1)
    assert [pace.value(i) for i in range(3)] == [1.0] * 3  # all level
    pace.add(0, 2)
    pace.finish(1)
    assert [pace.value(i) for i in (0, 2)] == [0.5, 1.0]  # two running
    pace.finish(2)
    assert pace.value(0) == 1.0  # alone now: the request ends with it
    pace.add(7, 3)  # a choice that never started counts for nothing
    assert pace.value(7) == 1.0


@pytest.mark.parametrize("free", [False, True])
def test_a_choice_ahead_of_its_request_asks_the_cap_with_less_value(free):
    """A request's choice ahead of the slowest running one asks the cap, for the draft model and for
    prompt lookup alike, with value 1/k (k choices running); level again, with 1; every round it
    reports counts its emitted tokens (accepted + 1) towards its pace."""
    from specdec.drafters import NgramDrafter
    from specdec.server.draft_cap import RequestPace
    from specdec.server.openai_api import _Job, _Request
    from toy_server import LetterTokenizer

    app = create_app(ToyLM(VOCAB, order=2, seed=3), tokenizer=LetterTokenizer(), settings=ServerSettings(),
                     drafter_factory=lambda: None, drafter_name="toy")
    fixed = FixedCap(3)
    app.state.ctx.draft_cap = fixed
    job = _Job(app.state.ctx, _Request(temperature=0), [[0, 1], [2, 3]], 8)
    pace = RequestPace(waiting=2)
    pace.start(0)
    pace.start(1)
    drafter = NgramDrafter() if free else object()
    gamma = job._gamma(drafter, 1, pace)

    def values() -> list[float]:
        fixed.values.clear()
        assert gamma.cap() == 3 and (free or gamma.free_limit() == 3)
        return fixed.values

    level, ahead = [1.0] * (1 if free else 2), [0.5] * (1 if free else 2)
    assert values() == level  # both at 0
    gamma.update(gamma=2, accepted=1, draft_s=0.0, target_s=0.0, other_s=0.0)  # choice 1: 2 tokens
    assert values() == ahead
    pace.add(0, 1)
    assert values() == ahead  # 2 against 1
    pace.add(0, 1)
    assert values() == level  # 2 against 2
    if not free:
        gamma.update_free(gamma=4, accepted=2, draft_s=0.0, target_s=0.0, other_s=0.0)  # a lookup round: 3 tokens
        pace.add(0, 2)
        assert values() == ahead  # 5 against 4
        pace.add(0, 1)
        assert values() == level
    fixed.values.clear()
    job._gamma(drafter, 1, None).cap()  # no pace (one choice): the plain threshold
    assert fixed.values == [1.0]


@pytest.mark.parametrize("rescale_above", [1e100, 1e3])
def test_acceptance_estimates_forget_old_rounds_geometrically(monkeypatch, rescale_above):
    """P(accepted >= k) weighs a round by ROUND_DECAY to the power of the drafted rounds after it:
    5,000 random rounds (γ 0-6, γ = 0 rounds carry nothing) against the same sums written out; with
    the weights' rescaling forced every ~3,500 rounds (1e3) too."""
    from specdec.server import draft_cap as mod

    monkeypatch.setattr(mod, "RESCALE_ABOVE", rescale_above)
    cap = DraftCap(CapConfig(window_s=1e9, min_passes=1, min_rounds=1, max_positions=6), costs=(0.001, 0.001))
    cap.observe_pass(10, 0.02)
    cap.observe_tokens(5)
    rng = random.Random(3)
    prop, acc = [0.0] * 6, [0.0] * 6
    for i in range(5000):
        gamma = rng.randint(0, 6)
        accepted = rng.randint(0, gamma)
        if i > 2500 and gamma:  # the acceptance drifts: the late rounds must dominate
            accepted = gamma
        cap.observe_round("greedy", gamma, accepted)
        if gamma:
            prop = [x * mod.ROUND_DECAY + (k < gamma) for k, x in enumerate(prop)]
            acc = [x * mod.ROUND_DECAY + (k < accepted) for k, x in enumerate(acc)]
    _, p = cap.estimate("greedy")
    assert p == pytest.approx([a / q for a, q in zip(acc, prop)], rel=1e-9)
    assert min(p) > 0.98  # the first half's rejections are all but forgotten (weight e^-4 by now)


def test_a_cost_curve_of_one_measured_row_count_is_refused():
    """A curve needs two row counts for a slope: one alone is a ValueError, not a curve whose
    slope reads outside its own data."""
    with pytest.raises(ValueError):
        RowCosts((1,), (0.1,))
    with pytest.raises(ValueError):
        RowCosts.measured((4,), (0.1,))


def _served(cap: DraftCap, rows: int = 3, seconds: float = 0.005, passes: int = 10) -> None:
    for _ in range(passes):
        cap.observe_pass(rows, seconds)
        cap.observe_tokens(2)


def test_min_rounds_counts_rounds_not_drafted_tokens():
    """A wire's acceptance is trusted after ``min_rounds`` verified rounds, however long each was:
    three rounds of 4 tokens are 3 rounds, not 12 (no estimate yet at min_rounds = 4)."""
    cap = DraftCap(CapConfig(window_s=1e9, min_passes=1, min_rounds=4, max_positions=4), costs=(0.002, 0.001))
    _served(cap)
    for _ in range(3):
        cap.observe_round("greedy", 4, 1)
    assert cap.estimate("greedy") is None and cap.cap("greedy") is None
    cap.observe_round("greedy", 4, 1)
    assert cap.estimate("greedy") is not None


def test_no_cap_while_the_passes_in_the_window_took_no_time():
    """Passes timed at 0 s (nothing measured about their cost) give no estimate, even with a cost
    curve from start-up: the threshold's E / T has no denominator."""
    cap = DraftCap(CapConfig(window_s=1e9, min_passes=1, min_rounds=1, max_positions=4), costs=(0.002, 0.001))
    _served(cap, seconds=0.0)
    cap.observe_round("greedy", 2, 0)
    assert cap.estimate("greedy") is None and cap.cap("greedy") is None


def test_a_falling_cost_curve_reads_as_free_rows_not_negative_ones():
    """m = b / (T / R) is clamped below at 0: a curve whose slope reads negative (noise) makes rows
    free (threshold 0), so a position never accepted is still cut (p = 0 is not > 0), where a
    negative threshold would keep every position."""
    cap = DraftCap(CapConfig(window_s=1e9, min_passes=1, min_rounds=1, max_positions=4), costs=(0.02, -0.001))
    _served(cap)
    for _ in range(8):
        cap.observe_round("greedy", 2, 1)  # position 1 always kept, position 2 never
    threshold, p = cap.estimate("greedy")
    assert threshold == 0.0 and p[:2] == [1.0, 0.0]
    assert cap.cap("greedy", wanted=2) == 1


def test_tokens_reported_for_a_finished_choice_do_not_bring_it_back():
    """Only running choices count: tokens added for a choice after its finish (or before its start)
    are ignored, so a finished choice neither counts among the k running nor sets the slowest."""
    from specdec.server.draft_cap import RequestPace

    pace = RequestPace()
    for c in range(3):
        pace.start(c)
    pace.add(0, 10)
    pace.add(1, 5)
    pace.add(2, 1)
    pace.finish(2)
    pace.add(2, 1)  # a late report of the finished choice
    pace.add(7, 1)  # ... and one of a choice never started
    assert pace.value(0) == pytest.approx(1 / 2)
    assert pace.value(1) == 1.0  # the slowest still running


def test_calibration_times_exactly_the_rows_asked_for_when_they_do_not_split_evenly():
    """13 rows over sequences of up to 8 are two sequences of 7 and 6 rows: a pass of 13 rows, not
    of 2 x 6 (the remainder is spread over the first sequences, never dropped)."""
    from specdec.server.draft_cap import calibrate
    from tiny import tiny_native

    model = tiny_native()
    passes = []
    forward_batch = model.forward_batch
    model.forward_batch = lambda items: passes.append(sorted(len(i[0]) for i in items)) or forward_batch(items)
    curve = calibrate(model, rows=(1, 13, 17), reps=1)
    assert curve.rows == (1, 13, 17)
    assert passes == [[1], [6, 7], [5, 6, 6]]


def test_the_cost_curve_is_read_at_the_mean_rows_per_pass_unrounded():
    """m = b R / T(R) at the mean rows per pass R, a fraction here (1 and 2 rows alternately: 1.5),
    with the start-up line T(R) = 10 ms + 1 ms per row: m = 1.5 / 11.5, threshold m · E / rows."""
    cap = DraftCap(CapConfig(window_s=1e9, min_passes=1, min_rounds=1, max_positions=4), costs=(0.01, 0.001))
    for rows in (1, 2) * 5:
        cap.observe_pass(rows, 0.01 + 0.001 * rows)
        cap.observe_tokens(1)
    cap.observe_round("greedy", 2, 1)
    threshold, _ = cap.estimate("greedy")
    assert threshold == pytest.approx((0.0015 / 0.0115) * 10 / 15)


def _fed(costs=None, tokens: int | None = 1) -> DraftCap:
    """4 passes of 10 rows (0.1 s), 4 rounds of γ = 3 all accepted, and ``tokens`` per pass."""
    clock = _Clock()
    cap = DraftCap(CapConfig(window_s=100.0, min_passes=2, min_rounds=2, max_positions=4), clock=clock, costs=costs)
    for _ in range(4):
        clock.t += 1.0
        cap.observe_pass(10, 0.1)
        if tokens:
            cap.observe_tokens(tokens)
        cap.observe_round("greedy", 3, 3)
    return cap


def test_no_cap_while_no_token_was_emitted_in_the_window():
    """Passes ran but nothing reported emitted tokens yet: ρ is unknown, so no cap (not ρ = 0, which
    would let every position through as if drafting were free)."""
    cap = _fed(costs=(0.01, 0.009), tokens=None)
    assert cap.estimate("greedy") is None and cap.cap("greedy") is None
    assert _fed(costs=(0.01, 0.009)).estimate("greedy") is not None  # the same with tokens: a cap


def test_a_cost_curve_of_zero_seconds_makes_rows_free():
    """A pass costing nothing at the mean rows (whole ≤ 0) reads as m = 0: threshold 0, not ρ."""
    threshold, p = _fed(costs=(0.0, 0.0), tokens=5).estimate("greedy")
    assert threshold == 0.0 and p[:3] == [1.0, 1.0, 1.0]


def test_a_cost_curve_needs_as_many_times_as_row_counts():
    with pytest.raises(ValueError, match="row costs"):
        RowCosts((1, 8, 32), (0.1, 0.2))
