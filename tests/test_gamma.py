import copy

import pytest

from specdec import defaults
from specdec.engine import make_gamma, parse_gamma
from specdec.errors import ConfigError
from specdec.gamma import (CappedGamma, CostGamma, FixedGamma, GammaMemory, GuideGamma, ObservedGamma, TreeBudget,
                           best_gamma, expected_tokens)


def test_guide_rule():
    g = GuideGamma()
    assert g.next_gamma() == 6
    g.update(gamma=6, accepted=5, draft_s=0, target_s=0, other_s=0)  # 0.83 >= 0.8
    assert g.next_gamma() == 7
    g.update(gamma=7, accepted=4, draft_s=0, target_s=0, other_s=0)  # 0.57: unchanged
    assert g.next_gamma() == 7
    for _ in range(10):
        g.update(gamma=g.next_gamma(), accepted=0, draft_s=0, target_s=0, other_s=0)
    assert g.next_gamma() == 3
    for _ in range(20):
        g.update(gamma=g.next_gamma(), accepted=g.next_gamma(), draft_s=0, target_s=0, other_s=0)
    assert g.next_gamma() == 12


def test_best_gamma_formula():
    # i.i.d. acceptance alpha: E = (1 - a^(g+1)) / (1 - a)  (Leviathan et al. eq. 1)
    a = 0.8
    profile = [a ** k for k in range(1, 13)]
    assert expected_tokens(profile, 4) == pytest.approx((1 - a**5) / (1 - a))
    # free drafting, flat target cost -> the longest draft
    g, _ = best_gamma(profile, 0.0, [1.0] * 13, 0.0)
    assert g == 12
    # drafting as expensive as the target -> no drafting
    g, _ = best_gamma(profile, 1.0, [1.0] * 13, 0.0)
    assert g == 0


def _run(ctrl: CostGamma, accept_rate: float, draft_s: float, target_s: float, rounds: int = 60) -> int:
    import random

    rng = random.Random(0)
    for _ in range(rounds):
        g = ctrl.next_gamma()
        acc = 0
        while acc < g and rng.random() < accept_rate:
            acc += 1
        ctrl.update(gamma=g, accepted=acc, draft_s=g * draft_s, target_s=target_s, other_s=0.0)
    return ctrl.next_gamma()


def test_cost_gamma_backs_off_and_grows():
    assert _run(CostGamma(), accept_rate=0.0, draft_s=0.002, target_s=0.02) in (0, defaults.COST_GAMMA_PROBE)  # a probe
    assert _run(CostGamma(), accept_rate=0.95, draft_s=0.0005, target_s=0.02) >= 8
    slow_draft = _run(CostGamma(), accept_rate=0.6, draft_s=0.015, target_s=0.02)
    assert slow_draft <= 2


def test_cost_gamma_probes_after_backing_off():
    ctrl = CostGamma(probe_every=4)
    seen = set()
    for _ in range(40):
        g = ctrl.next_gamma()
        seen.add(g)
        ctrl.update(gamma=g, accepted=0, draft_s=g * 0.01, target_s=0.02, other_s=0.0)
    assert 0 in seen and defaults.COST_GAMMA_PROBE in seen


def test_cost_gamma_starts_with_one_token_and_at_most_doubles():
    """The first round drafts one token; while every drafted token is accepted and drafting is
    cheap γ goes 1, 2, 4, 8, 12 (the ceiling), never more than twice the longest draft tried."""
    ctrl = CostGamma()
    seen = []
    for _ in range(6):
        g = ctrl.next_gamma()
        seen.append(g)
        ctrl.update(gamma=g, accepted=g, draft_s=g * 0.0005, target_s=0.02, other_s=0.0)
    assert seen == [1, 2, 4, 8, 12, 12], seen


def test_cost_gamma_loses_little_to_a_drafter_that_never_pays():
    """A drafter whose tokens are never accepted and cost 0.8 of a target step (early exit on a
    model not trained for it): over 64 rounds the controller drafts at most 4 tokens in all (the
    first round and the probes at rounds 8, 24, 56 -- one token each)."""
    ctrl = CostGamma()
    drafted = 0
    for _ in range(64):
        g = ctrl.next_gamma()
        drafted += g
        ctrl.update(gamma=g, accepted=0, draft_s=g * 0.016, target_s=0.02 + 0.002 * g, other_s=0.0)
    assert 1 <= drafted <= 4, drafted


def test_cost_gamma_probes_thin_out_while_drafting_loses_and_recover_when_it_pays():
    """A draft step as dear as a target step never pays: the probes' interval doubles (4, 8, 16,
    32, then 64 rounds), so 400 rounds hold at most 10 probes (a fixed interval of 4 gives ~80);
    once drafting pays again, the next probes bring the draft-cost estimate down and it drafts again."""
    ctrl = CostGamma(probe_every=4, max_probe_every=64)
    probes = []
    for i in range(400):
        g = ctrl.next_gamma()
        if g > 0 and i > 0:
            probes.append(i)
        ctrl.update(gamma=g, accepted=g, draft_s=g * 0.03, target_s=0.02, other_s=0.0)
    assert 3 <= len(probes) <= 10, probes
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == 64, gaps
    drafted = 0
    for _ in range(300):  # the draft became cheap: a few probes later drafting resumes
        g = ctrl.next_gamma()
        drafted += g > 0
        ctrl.update(gamma=g, accepted=g, draft_s=g * 0.0005, target_s=0.02, other_s=0.0)
    assert drafted >= 10 and ctrl.next_gamma() >= 2


def _drafted_rounds(step_s: float, row_s: float, *, accept: bool, rounds: int = 200) -> list[int]:
    """The rounds in which γ auto drafts, for a drafter whose token costs ``step_s`` (a plain
    round: 0.02 s) against a pass of ``0.02 + row_s γ`` seconds, its drafts all accepted or none."""
    ctrl = CostGamma()
    drafted = []
    for i in range(rounds):
        g = ctrl.next_gamma()
        if g:
            drafted.append(i)
        ctrl.update(gamma=g, accepted=g if accept else 0, draft_s=g * step_s, target_s=0.02 + row_s * g, other_s=0.0)
    return drafted


def test_cost_gamma_stops_probing_a_drafter_dearer_than_a_plain_round():
    """A drafted token that costs 1.2 plain rounds cannot pay even if always accepted: after the
    first probe (round 8) the next waits the longest interval (128 rounds), so 200 rounds draft
    3 times (rounds 0, 8, 136) -- doubling alone would probe at 8, 24, 56, 120 and 184.  One slow
    first round of a cheap drafter (a cold start) does not do that: from the probe on (round 8)
    it drafts every round."""
    assert _drafted_rounds(0.024, 0.001, accept=True) == [0, 8, 136]
    cold = CostGamma()
    rounds = []
    for i in range(40):
        g = cold.next_gamma()
        rounds.append(g)
        step = 0.5 if i == 0 else 0.001  # the first call 25 plain rounds long, then 1/20 of one
        cold.update(gamma=g, accepted=g, draft_s=g * step, target_s=0.02 + 0.001 * g, other_s=0.0)
    assert rounds[1:8] == [0] * 7 and all(g > 0 for g in rounds[8:]), rounds


def test_cost_gamma_stops_probing_a_drafter_that_loses_even_when_always_accepted():
    """A drafted token at 0.9 of a plain round, where each extra row of a pass costs 0.15 of one:
    an always-accepted draft of γ tokens takes 0.9 γ + 1 + 0.15 γ > γ + 1 plain rounds, so no γ
    pays.  After the first probe (round 8) the next waits the longest interval, as for a token
    dearer than a plain round.  A token at 0.8 of a round (1 + 0.95 γ < γ + 1) could pay and keeps
    the doubling intervals (probes at 8, 24, 56, 120)."""
    assert _drafted_rounds(0.018, 0.003, accept=False) == [0, 8, 136]
    assert _drafted_rounds(0.016, 0.003, accept=False) == [0, 8, 24, 56, 120]


def _idle_start_drafts(ctrl: CostGamma, rounds: int = 40) -> list[int]:
    """The rounds (of ``rounds``) in which ``ctrl`` drafted, each draft accepted whole at 0.03 s a
    draft token against a 0.02 s target pass (drafting never pays)."""
    drafted = []
    for i in range(rounds):
        g = ctrl.next_gamma()
        if g:
            drafted.append(i)
        ctrl.update(gamma=g, accepted=g, draft_s=g * 0.03, target_s=0.02, other_s=0.0)
    return drafted


def test_cost_gamma_started_idle_probes_only_after_the_longest_interval():
    """start_idle (a drafter known to cost a target step per token): no drafting until the first
    probe, max_probe_every rounds later."""
    ctrl = CostGamma(max_probe_every=32)
    ctrl.start_idle()
    drafted = _idle_start_drafts(ctrl)
    assert drafted == [32], drafted
    cheap = CostGamma(max_probe_every=32)  # a probe that shows drafting paying ends the idle start
    cheap.start_idle()
    gammas = []
    for _ in range(40):
        g = cheap.next_gamma()
        gammas.append(g)
        cheap.update(gamma=g, accepted=g, draft_s=g * 0.001, target_s=0.02, other_s=0.0)
    assert gammas[:32] == [0] * 32 and all(g > 0 for g in gammas[32:]), gammas
    for _ in range(40):  # ... and the probe interval is the short one again once drafting stops paying
        g = cheap.next_gamma()
        gammas.append(g)
        cheap.update(gamma=g, accepted=0, draft_s=g * 0.01, target_s=0.02, other_s=0.0)
    last = max(i for i, g in enumerate(gammas[:48]) if g > 0)
    assert any(g > 0 for g in gammas[48:60]), (last, gammas)


def test_parse_gamma():
    assert parse_gamma("auto") == "auto" and parse_gamma("guide") == "guide" and parse_gamma("5") == 5
    for bad in ("0", "-1", "x", "1000"):
        with pytest.raises(ConfigError):
            parse_gamma(bad)
    assert isinstance(make_gamma(3), FixedGamma) and isinstance(make_gamma("auto"), CostGamma)


# ---------------------------------------------------------------- tree budget controller
# A simulated decoder with fixed, fake per-round costs (no wall clock): each arm (0 = chain,
# else a tree of that many nodes) emits ``tokens`` per round in ``seconds``.


def _simulate(ctl, arms: dict[int, tuple[float, float]], rounds: int, *, switch_at: int | None = None,
              after: dict[int, tuple[float, float]] | None = None) -> tuple[list[int], float, float]:
    """Play ``rounds`` rounds; returns the arm of each round, total tokens and total seconds."""
    assert isinstance(ctl, TreeBudget)
    played, tokens, seconds = [], 0.0, 0.0
    for r in range(rounds):
        table = after if switch_at is not None and r >= switch_at and after is not None else arms
        arm = ctl.next_gamma() if ctl.tree_round else 0
        n, s = table[arm]
        played.append(arm)
        tokens += n
        seconds += s
        ctl.update(gamma=ctl.next_gamma(), accepted=int(n) - 1, draft_s=0.3 * s, target_s=0.7 * s, other_s=0.0)
    return played, tokens, seconds


#: chain 2 tokens / 20 ms (100 tok/s); trees with more tokens per round but slower
NO_PAY = {0: (2, 0.020), 4: (2, 0.024), 8: (3, 0.040), 16: (3, 0.060), 32: (4, 0.110)}
#: trees pay, 8 nodes best: 4 -> 120 tok/s, 8 -> 150, 16 -> 133, 32 -> 91
PAY = {0: (2, 0.020), 4: (3, 0.025), 8: (3, 0.020), 16: (4, 0.030), 32: (5, 0.055)}


def test_tree_budget_falls_back_to_the_chain_when_trees_do_not_pay():
    played, tokens, seconds = _simulate(TreeBudget(), NO_PAY, 300)
    assert played[:8] == [0] * 8  # the chain is measured first
    trees = [a for a in played if a]
    assert set(trees) == {4}  # no larger tree is probed while the smallest one loses to the chain
    assert len(trees) <= 6  # probes back off geometrically: rounds 8, 24, 56, 120, 184, 248
    assert tokens / seconds >= 0.97 * 100  # within 3% of the chain's own rate


def test_tree_budget_grows_trees_while_they_beat_the_chain():
    played, tokens, seconds = _simulate(TreeBudget(), PAY, 300)
    first = {a: played.index(a) for a in set(played)}
    assert first[4] < first[8] < first[16]  # a larger tree only after the smaller one won
    assert played[100:].count(8) >= 0.85 * 200  # then mostly the best tree
    assert tokens / seconds >= 0.9 * 150
    assert tokens / seconds > 1.3 * 100  # well above the chain


def test_tree_budget_returns_to_the_chain_when_trees_stop_paying():
    played, _, _ = _simulate(TreeBudget(), PAY, 300, switch_at=100, after=NO_PAY)
    assert played[99] == 8
    assert played[110:].count(0) >= 0.95 * 190  # back on the chain within a few rounds


def test_tree_budget_margin_keeps_the_chain_on_near_ties():
    near_tie = {0: (2, 0.020), 4: (2, 0.0196), 8: (2, 0.030), 16: (2, 0.04), 32: (2, 0.05)}  # tree 4: +2%
    played, _, _ = _simulate(TreeBudget(), near_tie, 200)
    assert played.count(0) >= 0.95 * 200
    played, _, _ = _simulate(TreeBudget(margin=1.0), near_tie, 200)
    assert played.count(4) >= 0.8 * 200  # without the margin the 2% better tree is played


def test_tree_budget_rejects_bad_settings():
    for bad in (dict(sizes=()), dict(margin=0.9), dict(probe_every=0), dict(probe_every=8, max_probe_every=4), dict(outlier=1.0)):
        with pytest.raises(ValueError):
            TreeBudget(**bad)


@pytest.mark.parametrize("bad", [dict(max_gamma=0), dict(start=-1), dict(max_gamma=2, start=3),
                                 dict(probe_gamma=0), dict(max_gamma=2, probe_gamma=4), dict(probe_every=0),
                                 dict(probe_every=8, max_probe_every=4), dict(decay=0.0), dict(decay=1.5),
                                 dict(outlier=1.0)])
def test_cost_gamma_rejects_bad_settings(bad):
    """Settings it cannot run with are refused when it is built, not found out rounds later (a
    probe longer than max_gamma used to fail with an IndexError on its 128th round)."""
    with pytest.raises(ValueError, match="γ controller"):
        CostGamma(**bad)


def test_cost_gamma_takes_its_boundary_settings():
    CostGamma(max_gamma=1, start=0, probe_gamma=1, probe_every=4, max_probe_every=4, decay=1.0)
    CostGamma(max_gamma=3, start=3, probe_gamma=3)


def test_tree_budget_is_not_thrown_off_by_one_preempted_round():
    """One chain round slowed 4x (another process took the core) must not hand the game to a
    tree that is slower than the chain."""
    ctl = TreeBudget()
    played = []
    for r in range(120):
        arm = ctl.next_gamma() if ctl.tree_round else 0
        n, s = NO_PAY[arm]
        if r == 40:
            assert arm == 0
            s *= 4
        played.append(arm)
        ctl.update(gamma=ctl.next_gamma(), accepted=n - 1, draft_s=0.3 * s, target_s=0.7 * s, other_s=0.0)
    assert played[41:].count(0) >= 0.95 * 79


def test_cost_gamma_extrapolates_the_pass_costs_it_has_not_measured():
    """Before any γ = 0 round the one-row cost is extrapolated from the measured sizes (not read
    as the two-row cost, which made one drafted token look free); beyond the largest size it
    grows along the last slope; it never falls below half the cheapest measured pass, nor rises
    above a larger measured one."""
    ctrl = CostGamma()
    ctrl.observe_cost(2, 7.0)
    ctrl.observe_cost(4, 9.0)
    assert ctrl._target_cost(1) == pytest.approx(6.0)
    assert ctrl._target_cost(3) == pytest.approx(8.0)
    assert ctrl._target_cost(6) == pytest.approx(11.0)
    steep = CostGamma()
    steep.observe_cost(2, 2.0)
    steep.observe_cost(3, 10.0)
    assert steep._target_cost(1) == pytest.approx(1.0)  # the floor, not -6
    one = CostGamma()
    one.observe_cost(3, 5.0)
    assert one._target_cost(1) == one._target_cost(8) == 5.0
    noisy = CostGamma()  # a 3-row pass read cheaper than a 2-row one: no size below reads dearer
    noisy.observe_cost(2, 7.8)
    noisy.observe_cost(3, 7.3)
    assert noisy._target_cost(1) == pytest.approx(7.3)  # the line through them would give 8.3


def _patterned(ctrl: CostGamma, pattern: list[int], *, rounds: int = 200, first_misses: int = 0) -> tuple[int, float]:
    """Drive ``ctrl`` with drafted tokens accepted as ``pattern`` cycles (1 = accepted), after
    ``first_misses`` rejected ones, on a machine like a 2-core Zen 5 with the default drafter: a
    one-row pass 2.5 ms, each extra row 0.15 ms, a drafted token 0.4 ms, 0.1 ms of rule.  Returns
    the rounds that drafted and the speed over plain decoding (2.6 ms a token)."""
    k, drafted, seconds, tokens = 0, 0, 0.0, 0
    for _ in range(rounds):
        g = ctrl.next_gamma()
        accepted = 0
        for _ in range(g):
            if first_misses > 0:
                first_misses, hit = first_misses - 1, 0
            else:
                hit, k = pattern[k % len(pattern)], k + 1
            if not hit:
                break
            accepted += 1
        drafted += g > 0
        target_s, draft_s = 0.0025 + 0.00015 * g, 0.0004 * g
        ctrl.update(gamma=g, accepted=accepted, draft_s=draft_s, target_s=target_s, other_s=0.0001)
        seconds += draft_s + target_s + 0.0001
        tokens += accepted + 1
    return drafted, tokens / seconds * 0.0026


def test_cost_gamma_keeps_drafting_through_a_run_of_misses():
    """Drafted tokens accepted 5 times in 11 (one drafted token pays from ~0.21 here), after six
    misses in a row at the start: the controller drafts in every one of 200 rounds, ~1.18x plain.
    With the prior's old weight (2) the misses drove the estimate below break-even and it stopped
    drafting for most of the run (77 of 200 rounds, ~1.06x): it learns nothing while it does not draft."""
    pattern = [1, 0, 1, 0, 0, 1, 0, 1, 0, 0, 1]
    drafted, speed = _patterned(CostGamma(), pattern, first_misses=6)
    assert drafted == 200 and speed > 1.15, (drafted, speed)
    old_drafted, old_speed = _patterned(CostGamma(prior_weight=2.0), pattern, first_misses=6)
    assert old_drafted < 100 and old_speed < speed - 0.05, (old_drafted, old_speed)


def test_cost_gamma_still_backs_off_where_acceptance_does_not_pay():
    """One drafted token in ten accepted (below the ~0.21 where one token pays): the controller
    drafts in few of 200 rounds and loses little to plain decoding (a prior weighted 10 kept
    drafting in all 200, at ~0.9x plain)."""
    drafted, speed = _patterned(CostGamma(), [1] + [0] * 9)
    assert drafted <= 40 and speed > 0.97, (drafted, speed)
    heavy_drafted, heavy_speed = _patterned(CostGamma(prior_weight=10.0), [1] + [0] * 9)
    assert heavy_drafted == 200 and heavy_speed < 0.93, (heavy_drafted, heavy_speed)


def _losing_drafter(ctrl: CostGamma, rounds: int, rng, *, slow_plain_pass: bool = False) -> int:
    """Rounds of a drafter that cannot pay at its acceptance (a drafted token ~0.9 of a plain round,
    half accepted: early exit near the top of the target); returns the rounds that drafted.  With
    ``slow_plain_pass`` the first plain round takes 6.7 ms instead of 2.9 (another process ran)."""
    drafted = 0
    for _ in range(rounds):
        g = ctrl.next_gamma()
        acc = 0
        while acc < g and rng.random() < 0.5:
            acc += 1
        target = 0.0029 + 0.0004 * g if g else (0.0067 if slow_plain_pass else 0.0029)
        slow_plain_pass = slow_plain_pass and g > 0
        ctrl.update(gamma=g, accepted=acc, draft_s=g * 0.0026, target_s=target, other_s=0.0001)
        drafted += g > 0
    return drafted


def test_one_slow_plain_pass_does_not_set_a_losing_drafter_drafting():
    """One disturbed one-row pass used to lift the one-row estimate above the two-row one; drafting
    rounds never measure it again, so the drafter kept drafting at a loss (seen: 58 rounds in a row
    of `layerskip:24` on a 2-core Zen 5).  A pass counts at most 1.5 times the estimate, and a
    size never reads dearer than a larger one.  16 sequences of 60 rounds after a 40-round start."""
    import random

    streaks = []
    for seed in range(16):
        rng = random.Random(seed)
        ctrl = CostGamma()
        _losing_drafter(ctrl, 40, rng)
        assert ctrl.next_gamma() == 0  # backed off
        streaks.append(_losing_drafter(ctrl, 60, rng, slow_plain_pass=True))
    # a probe or a short run that lucky acceptances prolong, not dozens of drafted rounds (before
    # the fix: 265 drafted rounds in all, up to 59 of the 60 in one sequence)
    assert sum(streaks) <= 16 and max(streaks) <= 8, streaks


def test_outliers_are_clipped_and_the_cost_curve_never_falls_with_rows():
    ctrl = CostGamma()
    ctrl.observe_cost(1, 0.003)
    ctrl.observe_cost(1, 0.030)  # ten times the estimate: counts as 1.5 times
    assert ctrl._target_cost(1) == pytest.approx(0.7 * 0.003 + 0.3 * 0.0045)
    ctrl.observe_cost(2, 0.0031)
    assert ctrl._target_cost(1) == pytest.approx(0.0031)  # not dearer than the two-row pass


def test_one_stalled_first_round_does_not_keep_a_paying_drafter_backed_off():
    """A first round stalled as a whole (its draft and its two-row pass 300 ms against ~0.1 and
    ~12 ms) used to set the two-row cost for good: probes found drafting hopeless, thinned out to
    one in 128 rounds, each took off only 30 % of the excess, and the successors carried it, so a
    drafter accepted 3 times in 4 drafted one token per sequence for seven sequences (seen in a
    `specdec bench` run of Gemma-3-270M with prompt lookup).  A reading below the estimate / 1.5
    now replaces it.  8 sequences of 128 rounds, acceptance drawn at 0.75 a position (seed 0)."""
    import random

    rng, memory, drafted = random.Random(0), GammaMemory(), []
    for seq in range(8):
        ctrl, tokens = memory.next("greedy"), 0
        for r in range(128):
            g = ctrl.next_gamma()
            acc = 0
            while acc < g and rng.random() < 0.75:
                acc += 1
            target, draft = 0.0114 + 0.0006 * g, 0.0001 * g
            if seq == r == 0:
                target, draft, acc = 0.3, 0.3, 0
            ctrl.update(gamma=g, accepted=acc, draft_s=draft, target_s=target, other_s=0.0003)
            tokens += g
        memory.keep("greedy", ctrl)
        drafted.append(tokens)
    # each sequence drafts hundreds of tokens (before the fix: 2, 1, 1, 1, 1, 1, 1, 1)
    assert min(drafted) >= 300, drafted
    assert ctrl._target_cost(2) == pytest.approx(0.0126, rel=0.1)


def test_a_successor_stays_backed_off_only_for_a_drafter_that_cannot_pay():
    """``successor``: after a drafter whose token costs ~0.9 of a plain round (it would lose even at
    an acceptance of 0.5 at every position) the next sequence starts backed off at the interval
    reached, with its costs and the acceptance at COST_GAMMA_CARRY of its weight; after a cheap
    drafter, even one that ended backed off on a prompt where it did not pay, a fresh start."""
    import random

    losing = CostGamma()
    _losing_drafter(losing, 200, random.Random(3))
    nxt = losing.successor()
    assert nxt.next_gamma() == 0 and nxt._interval == losing._interval >= 2 * defaults.COST_GAMMA_PROBE_EVERY
    assert nxt._draft_s == losing._draft_s and nxt._target_s == losing._target_s and nxt._target_s is not losing._target_s
    assert nxt._tries == pytest.approx([defaults.COST_GAMMA_CARRY * t for t in losing._tries])
    assert nxt._since_draft == losing._since_draft  # the probe schedule runs on
    ctrl, probed = losing, False
    for _ in range(losing._interval):  # sequences of three rounds each, shorter than the interval ...
        ctrl = ctrl.successor()
        for _ in range(3):
            probed = probed or ctrl.next_gamma() > 0
            _losing_drafter(ctrl, 1, random.Random(0))
        if probed:
            break
    assert probed  # ... still reach a probe (with a fresh count each, none ever would)
    cheap = CostGamma()
    _run(cheap, accept_rate=0.0, draft_s=0.002, target_s=0.02, rounds=200)  # a tenth of a step, never accepted
    assert cheap.next_gamma() == 0  # backed off on this prompt ...
    fresh = cheap.successor()  # ... but the next prompt starts afresh
    assert fresh.next_gamma() == defaults.COST_GAMMA_START and fresh._draft_s is None and fresh._interval == defaults.COST_GAMMA_PROBE_EVERY
    paying = CostGamma()
    _run(paying, accept_rate=0.9, draft_s=0.0005, target_s=0.02)
    assert paying.successor()._draft_s is None
    assert CostGamma().successor().next_gamma() == defaults.COST_GAMMA_START


def test_a_successor_judges_a_drafter_by_its_cheapest_token():
    """A cheap drafter (0.3 ms a token against a 2.9 ms step) that stops being accepted backs off;
    its probes after plain rounds read 2.6 ms a token (the draft catching up on what it missed), so
    its running estimate ends dear enough to lose even at an acceptance of 0.5.  The next sequence
    still starts afresh: judged by the cheapest token measured, it could pay on another prompt."""
    ctrl, drafted_last = CostGamma(), True  # the first round follows the prefill: nothing to catch up
    for i in range(300):
        g = ctrl.next_gamma()
        step = 0.0003 if drafted_last else 0.0026  # a round after plain rounds catches up first
        ctrl.update(gamma=g, accepted=g if i < 3 else 0, draft_s=g * step, target_s=0.0029 + 0.0004 * g,
                    other_s=0.0001)
        drafted_last = g > 0
    assert ctrl.next_gamma() == 0 and ctrl._draft_min == pytest.approx(0.0003)
    hoped = [defaults.COST_GAMMA_CARRY_ACCEPT ** (k + 1) for k in range(ctrl.max_gamma)]
    assert best_gamma(hoped, ctrl._draft_s, ctrl._costs(), ctrl._other_s)[0] == 0  # the running estimate loses
    nxt = ctrl.successor()
    assert nxt._draft_s is None and nxt.next_gamma() == defaults.COST_GAMMA_START


def test_an_engine_hands_each_sequence_the_last_ones_controller_per_rule():
    import random

    from specdec.drafters import ModelDrafter
    from specdec.engine import Engine
    from specdec.models.registry import LoadedModel
    from specdec.models.toy import ToyLM
    from specdec.verify import get_rule

    target = ToyLM(8, order=2, seed=4)
    engine = Engine(LoadedModel("toy", target, None, None, "toy", frozenset()), ModelDrafter(target.perturbed(1.0, seed=9)), "toy")
    greedy, block = get_rule("greedy"), get_rule("block")
    first = engine.decoder(greedy).gamma
    _losing_drafter(first, 200, random.Random(5))  # as the decoder would drive it
    assert isinstance(engine.decoder(greedy, gamma=3).gamma, FixedGamma)  # a fixed γ leaves the hand-over alone
    second = engine.decoder(greedy).gamma
    assert second is not first and second.next_gamma() == 0 and second._draft_s == first._draft_s
    assert engine.decoder(block).gamma._draft_s is None  # another rule: its own, fresh


def test_an_observed_tree_budget_plays_as_the_budget_and_reports_each_update():
    """The server wraps a tree's node budget to count its rounds' drafted nodes: the wrapped budget
    plays exactly the rounds the bare one plays (its ``tree_round`` and all), and every update is
    reported."""
    from specdec.gamma import ObservedGamma, TreeBudget

    seen: list[tuple[int, int]] = []
    bare_played, *_ = _simulate(TreeBudget(), PAY, 200)
    wrapped = ObservedGamma(TreeBudget(), lambda gamma, accepted: seen.append((gamma, accepted)))
    played = []
    for r in range(200):
        arm = wrapped.next_gamma() if wrapped.tree_round else 0
        n, s = PAY[arm]
        played.append(arm)
        wrapped.update(gamma=wrapped.next_gamma(), accepted=int(n) - 1, draft_s=0.3 * s, target_s=0.7 * s, other_s=0.0)
    assert played == bare_played and len(seen) == 200 and wrapped.name == TreeBudget().name


def test_guide_rule_grows_at_exactly_the_up_ratio():
    """+1 when accepted / γ >= 0.8: 4 of 5 accepted is exactly 0.8 and grows γ; 2 of 5 (0.4) shrinks it."""
    g = GuideGamma(gamma=5)
    g.update(gamma=5, accepted=4, draft_s=0, target_s=0, other_s=0)
    assert g.next_gamma() == 6
    g = GuideGamma(gamma=5)
    g.update(gamma=5, accepted=2, draft_s=0, target_s=0, other_s=0)
    assert g.next_gamma() == 4


def test_capped_gamma_only_lowers_the_inner_choice():
    """The cap is a ceiling: a cap above the inner γ leaves it alone; one below it wins; no cap, no change."""
    assert CappedGamma(FixedGamma(3), cap=lambda g: 10).next_gamma() == 3
    assert CappedGamma(FixedGamma(3), cap=lambda g: 2).next_gamma() == 2
    assert CappedGamma(FixedGamma(3), cap=lambda g: None).next_gamma() == 3
    assert CappedGamma(FixedGamma(3), cap=lambda g: -1).next_gamma() == 0


def test_a_moderately_cheaper_pass_is_smoothed_in_not_taken_at_once():
    """Only a reading far below the estimate (by more than the outlier factor) replaces it; a
    reading somewhat below is smoothed in like any other."""
    ctrl = CostGamma()
    ctrl.observe_cost(2, 0.010)
    ctrl.observe_cost(2, 0.008)  # 0.008 * 1.5 = 0.012 >= 0.010: smoothed
    assert ctrl._target_cost(2) == pytest.approx(0.7 * 0.010 + 0.3 * 0.008)
    ctrl.observe_cost(2, 0.005)  # 0.005 * 1.5 < 0.0094: taken at once
    assert ctrl._target_cost(2) == pytest.approx(0.005)


def test_a_known_round_trip_is_added_to_every_pass_cost():
    """``extra_target_s`` (a network round trip) counts in each verification pass's cost, so a
    remote target makes drafting pay sooner: here a drafter that loses locally drafts remotely."""
    local, remote = CostGamma(), CostGamma(extra_target_s=0.1)
    for ctrl in (local, remote):
        ctrl.observe_cost(1, 0.010)
    assert local._target_cost(1) == pytest.approx(0.010)
    assert remote._target_cost(1) == pytest.approx(0.110)
    # a token costs 0.009 s, a plain round 0.010 s, half the drafts accepted: locally not worth it
    for ctrl in (local, remote):
        for _ in range(30):
            g = max(ctrl.next_gamma(), 1)
            ctrl.update(gamma=g, accepted=g // 2, draft_s=0.009 * g, target_s=0.010, other_s=0.0)
    assert remote.next_gamma() > local.next_gamma()


def test_probe_interval_never_exceeds_its_maximum():
    """A drafter that loses (every draft rejected) but is not hopeless (a token at 0.4 of a plain
    round): the interval between probes doubles up to ``max_probe_every`` and stays there (500 rounds)."""
    ctrl = CostGamma(probe_every=2, max_probe_every=16)
    drafted = []
    for i in range(500):
        g = ctrl.next_gamma()
        if g:
            drafted.append(i)
        ctrl.update(gamma=g, accepted=0, draft_s=0.008 * g, target_s=0.02 + 0.002 * g, other_s=0.0)
    gaps = [b - a for a, b in zip(drafted, drafted[1:])]
    assert max(gaps) <= 16, gaps
    assert gaps[-5:] == [16] * 5, gaps  # a probe every 16 rounds at the end


def test_tree_budget_probes_right_after_its_warmup():
    """The chain is measured for exactly ``warmup`` rounds before the first tree probe."""
    budget = TreeBudget(warmup=4, probe_every=2, max_probe_every=8)
    trees = []
    for i in range(8):
        trees.append(budget.tree_round)
        g = budget.next_gamma()
        budget.update(gamma=g, accepted=0, draft_s=0.001 * g, target_s=0.02, other_s=0.0)
    assert trees.index(True) == 4, trees


def test_a_probe_scheduled_as_a_sequence_ends_is_the_next_sequences_first_round():
    """A backed-off controller whose last round scheduled a probe (γ = probe_gamma for the next
    round) has not gone back to drafting: its successor carries the costs and runs that probe
    first, then judges it as a probe (it had been read as "still drafting" and started afresh)."""
    import random

    ctrl = CostGamma()
    rng = random.Random(3)
    _losing_drafter(ctrl, 200, rng)
    while not (ctrl._probing and ctrl.next_gamma() > 0):  # rounds until the last one schedules a probe
        _losing_drafter(ctrl, 1, rng)
    nxt = ctrl.successor()
    assert nxt._target_s == ctrl._target_s and nxt._draft_s == ctrl._draft_s  # carried, not fresh
    assert nxt.next_gamma() == ctrl.probe_gamma
    interval = nxt._interval
    _losing_drafter(nxt, 1, random.Random(0))  # the probe loses: the interval doubles, back off
    assert nxt.next_gamma() == 0 and nxt._interval == min(2 * interval, nxt.max_probe_every)


def test_pass_costs_outside_the_measured_sizes_follow_the_line_through_the_nearest_two():
    """Below the smallest measured size, the line through the two smallest; above the largest,
    the line through the two largest (measured: 2 rows 10 ms, 3 rows 11 ms, 5 rows 20 ms)."""
    c = CostGamma()
    for n, t in ((2, 0.010), (3, 0.011), (5, 0.020)):
        c.observe_cost(n, t)
    assert c._target_cost(1) == pytest.approx(0.009)  # 10 - (11 - 10): the (2, 3) line
    assert c._target_cost(6) == pytest.approx(0.0245)  # 20 + (20 - 11) / 2: the (3, 5) line
    assert c._target_cost(4) == pytest.approx(0.0155)  # between 3 and 5


def test_a_successor_of_a_controller_that_never_drafted_starts_afresh():
    """A controller started idle (start_idle) that ended before its first probe measured nothing
    about drafting: its successor is a fresh controller (no error, no carried state)."""
    idle = CostGamma()
    idle.start_idle()
    for _ in range(3):
        idle.update(gamma=0, accepted=0, draft_s=0.0, target_s=0.02, other_s=0.0)
    nxt = idle.successor()
    assert nxt.next_gamma() == defaults.COST_GAMMA_START and nxt._draft_s is None


def _paying_at_gamma_one() -> CostGamma:
    """max_gamma 1: a drafted token at 6 ms against a 10 ms pass, every draft accepted (it pays:
    2 tokens in 16 ms), though at the hoped-for acceptance of 0.5 it would not (1.5 in 16 ms)."""
    c = CostGamma(max_gamma=1)
    for _ in range(10):
        c.update(gamma=1, accepted=1, draft_s=0.006, target_s=0.010, other_s=0.0)
    return c


def test_a_successor_of_a_controller_still_drafting_one_token_starts_afresh():
    """Only a controller that ended backed off (γ = 0) passes on its costs; one drafting at γ = 1 does not."""
    c = _paying_at_gamma_one()
    assert c.next_gamma() == 1
    nxt = c.successor()
    assert nxt.next_gamma() == defaults.COST_GAMMA_START and nxt._draft_s is None


def _backed_off(step_s: float) -> CostGamma:
    """max_gamma 1, accepted only in the first round, 10 ms passes: backs off; then 3 plain rounds."""
    c = CostGamma(max_gamma=1)
    for i in range(20):
        g = c.next_gamma()
        c.update(gamma=g, accepted=g if i == 0 else 0, draft_s=g * step_s, target_s=0.010, other_s=0.001)
        if g == 0 and c.next_gamma() == 0 and c._since_draft >= 3:
            break
    assert c.next_gamma() == 0
    return c


def test_a_successor_hopes_for_an_acceptance_of_one_half_at_the_first_position():
    """A drafted token at 4 ms against a 10 ms pass (+1 ms overhead) pays at an acceptance of 0.5
    (1.5 tokens in 15 ms beat 1 in 11 ms): the next sequence starts afresh even though this one
    ended backed off.  At 8 ms a token it would not (1.5 in 19 ms): the next one stays backed off."""
    fresh = _backed_off(0.004).successor()
    assert fresh._draft_s is None and fresh.next_gamma() == defaults.COST_GAMMA_START
    carried = _backed_off(0.008).successor()
    assert carried._draft_s is not None and carried.next_gamma() == 0


def test_a_carried_successor_keeps_the_rest_of_a_round_and_scales_hits_and_tries_alike():
    c = _backed_off(0.008)
    nxt = c.successor()
    assert nxt._other_s == c._other_s > 0
    carry = defaults.COST_GAMMA_CARRY
    assert c._hits[0] > 0
    assert nxt._hits == pytest.approx([carry * h for h in c._hits])
    assert nxt._tries == pytest.approx([carry * t for t in c._tries])
    assert nxt.accept_profile()[0] <= 1.0


def test_a_successor_keeps_every_setting():
    """The settings (a known round trip, the outlier factor, ...) belong to the drafter and the
    machine: a fresh or a carried successor has the same ones."""
    settings = dict(max_gamma=7, start=2, decay=0.8, probe_every=4, probe_gamma=2, max_probe_every=16,
                    prior_accept=0.6, prior_weight=3.0, outlier=2.0, extra_target_s=0.05)
    nxt = CostGamma(**settings).successor()
    assert {k: getattr(nxt, k) for k in settings} == settings
    nxt.observe_cost(1, 0.01)
    assert nxt._target_cost(1) == pytest.approx(0.06)  # the round trip is added to its passes too


def test_hopeless_judges_by_the_cheaper_of_the_estimate_and_the_round_just_measured():
    """A running estimate of 30 ms a token (a plain round: 20 ms) is hopeless; a round just measured
    at 1 ms a token says it is not."""
    c = CostGamma()
    c.update(gamma=1, accepted=1, draft_s=0.03, target_s=0.02, other_s=0.0)
    c.observe_cost(1, 0.02)
    assert c.hopeless(0.03) and not c.hopeless(0.001)


def test_a_pass_exactly_one_outlier_factor_cheaper_is_smoothed_in():
    """Only a reading *below* estimate / outlier replaces the estimate; one exactly at it is smoothed
    in (0.7 old + 0.3 new).  Powers of two keep the arithmetic exact: 0.5 * 1.5 == 0.75."""
    c = CostGamma(outlier=1.5)
    c.observe_cost(2, 0.75)
    c.observe_cost(2, 0.5)
    assert c._target_s[2] == pytest.approx(0.7 * 0.75 + 0.3 * 0.5)
    c.observe_cost(2, 0.1)  # far below: taken at once
    assert c._target_s[2] == pytest.approx(0.1)


def test_rounds_that_drafted_nothing_keep_the_start_value():
    """Before anything about drafting is measured (a drafter that proposed nothing yet), γ stays at
    its start value however many plain rounds pass (only a start_idle controller probes then)."""
    c = CostGamma(start=3, probe_every=2)
    for _ in range(10):
        c.update(gamma=0, accepted=0, draft_s=0.0, target_s=0.02, other_s=0.0)
    assert c.next_gamma() == 3


def test_the_rest_of_a_round_is_smoothed_in_at_three_tenths():
    """other_s is a running estimate: 0.7 of the old one plus 0.3 of the new reading."""
    c = CostGamma(max_gamma=1)
    c.update(gamma=1, accepted=1, draft_s=0.001, target_s=0.01, other_s=0.01)
    assert c._other_s == pytest.approx(0.003)
    c.update(gamma=1, accepted=1, draft_s=0.001, target_s=0.01, other_s=0.0)
    assert c._other_s == pytest.approx(0.0021)


def test_a_probe_that_wins_resets_the_probe_interval():
    """Probes of a dear drafter thin out to the longest interval (64); once drafting pays again the
    interval is the shortest (4) again, so when it stops paying the first probe comes 4 rounds
    after its last drafting round, not 64."""
    c = CostGamma(probe_every=4, max_probe_every=64)
    for _ in range(200):
        g = c.next_gamma()
        c.update(gamma=g, accepted=0, draft_s=g * 0.03, target_s=0.02, other_s=0.0)
    assert c._interval == 64
    for _ in range(200):
        g = c.next_gamma()
        c.update(gamma=g, accepted=g, draft_s=g * 0.0005, target_s=0.02, other_s=0.0)
    gammas = []
    for _ in range(40):
        g = c.next_gamma()
        gammas.append(g)
        c.update(gamma=g, accepted=0, draft_s=g * 0.01, target_s=0.02, other_s=0.0)
    last = gammas.index(0) - 1  # its update chose γ = 0 and counted the first round of the interval
    probe = next(i for i in range(last + 1, 40) if gammas[i] > 0)
    assert probe - last == 4, gammas


def test_a_plain_round_that_chooses_drafting_restarts_the_probe_count():
    """Backed off 3 rounds into a probe interval, a plain round whose overhead makes drafting pay
    (1 s of other work a round) resumes drafting, and the count towards the next probe starts over."""
    c = CostGamma(max_gamma=1)
    for _ in range(40):
        g = c.next_gamma()
        c.update(gamma=g, accepted=0, draft_s=g * 0.002, target_s=0.01, other_s=0.0)
        if g == 0 and c.next_gamma() == 0 and c._since_draft >= 3:
            break
    assert c.next_gamma() == 0 and c._since_draft == 3
    c.update(gamma=0, accepted=0, draft_s=0.0, target_s=0.01, other_s=1.0)
    assert c.next_gamma() == 1 and c._since_draft == 0


# ---- TreeBudget


def test_tree_budget_rejects_a_zero_node_budget_and_accepts_equal_probe_intervals():
    with pytest.raises(ValueError, match="positive"):
        TreeBudget(sizes=(0, 4))
    assert TreeBudget(probe_every=8, max_probe_every=8)._interval == 8  # a fixed interval is fine


def test_tree_budget_arms_are_the_sorted_distinct_sizes_and_it_probes_the_smallest_first():
    tb = TreeBudget(sizes=(16, 4, 8, 4))
    assert tb.arms == [0, 4, 8, 16]
    assert tb._probe_target() == 4  # best is the chain: the smallest tree


@pytest.mark.parametrize("best, targets", [(8, [0, 16, 4, 0, 16, 4]), (4, [0, 8, 0, 8]), (16, [0, 8, 0, 8])])
def test_tree_budget_probes_the_chain_then_the_next_larger_then_the_next_smaller_tree(best, targets):
    """With a tree best, probes take the chain, the next larger and the next smaller tree in turn
    (the chain counted once, never again as the 'smaller' neighbour of the smallest tree)."""
    tb = TreeBudget(sizes=(4, 8, 16))
    tb._best = best
    got = []
    for p in range(len(targets)):
        tb._probes = p
        got.append(tb._probe_target())
    assert got == targets


def _chain_round(tb: TreeBudget, seconds: float) -> None:
    tb.update(gamma=1, accepted=0, draft_s=0.0, target_s=seconds, other_s=0.0)


def test_tree_budget_counts_an_arms_first_two_rounds_in_full_and_clamps_from_the_third():
    """The outlier clamp (at most ``outlier`` times the arm's mean round) needs two rounds of
    reference: the second round counts in full, the third is clamped."""
    tb = TreeBudget(warmup=100, decay=1.0, outlier=2.0)  # no probes: chain rounds only
    _chain_round(tb, 1.0)
    _chain_round(tb, 10.0)  # in full: the mean of one round is no reference
    assert tb._seconds[0] == pytest.approx(11.0)
    _chain_round(tb, 100.0)  # clamped to 2 * 11 / 2
    assert tb._seconds[0] == pytest.approx(22.0)


def test_tree_budget_plays_a_tree_only_when_it_beats_the_chain_by_more_than_the_margin():
    """Exactly margin times the chain's rate is a tie the chain keeps (exact binary fractions)."""
    tb = TreeBudget(sizes=(4,), margin=2.0, warmup=1, probe_every=1, max_probe_every=1)
    tb.update(gamma=1, accepted=0, draft_s=0.25, target_s=0.5, other_s=0.25)  # chain: 1 token / s
    assert tb.tree_round  # the probe of the tree
    tb.update(gamma=4, accepted=1, draft_s=0.25, target_s=0.5, other_s=0.25)  # tree: 2 tokens / s
    assert tb.rate(4) == 2.0 * tb.rate(0)
    assert tb.best_arm() == 0


def test_capped_gamma_reports_free_rounds_only_to_the_free_observer():
    """A free draft's round (prompt lookup's) goes to ``observe_free``, never to ``observe`` (the
    server tracks the two on different wires); a chain round goes to ``observe`` only."""
    chain, free = [], []
    g = CappedGamma(FixedGamma(3), cap=lambda g: None, observe=lambda g, a: chain.append((g, a)),
                    observe_free=lambda g, a: free.append((g, a)))
    g.update_free(gamma=4, accepted=2, draft_s=0.0, target_s=0.01, other_s=0.0)
    assert free == [(4, 2)] and chain == []
    g.update(gamma=3, accepted=1, draft_s=0.0, target_s=0.01, other_s=0.0)
    assert free == [(4, 2)] and chain == [(3, 1)]


def test_a_successor_hopes_for_an_iid_acceptance_of_one_half_not_one_half_at_every_depth():
    """The successor's test hopes for P(accepted >= k) = 0.5 ** k (i.i.d. one half), not 0.5 at
    every depth: with a 2-row pass twice a 1-row one, no dearer beyond, and drafted tokens almost
    free, the i.i.d. hope gives at most 2 tokens for 2 s (a loss), so the backed-off controller's
    successor stays backed off; a flat 0.5 would hope for 7 tokens at γ = 12 and start afresh."""
    c = CostGamma()
    c.observe_cost(1, 1.0)
    c.observe_cost(13, 2.0)
    for _ in range(4):  # drafted tokens always rejected
        c.update(gamma=1, accepted=0, draft_s=0.001, target_s=2.0, other_s=0.0)
    assert c.next_gamma() == 0 and not c._probing  # backed off
    nxt = c.successor()
    assert nxt._draft_s == c._draft_s and nxt.next_gamma() == 0  # carried, still backed off


def test_a_controller_that_measured_nothing_is_not_hopeless():
    """hopeless() is a judgement on measured draft costs: before any drafted round it says False."""
    assert CostGamma().hopeless(1.0) is False


def test_a_winning_probe_of_one_token_resets_the_probe_interval():
    """A probe wins when the best γ after it is > 0, including exactly 1 (here max_gamma = 1): the
    interval goes back to probe_every instead of doubling."""
    c = CostGamma(max_gamma=1, probe_every=4, max_probe_every=64)
    for _ in range(200):  # a dear drafter: probes thin out
        g = c.next_gamma()
        c.update(gamma=g, accepted=0, draft_s=g * 0.03, target_s=0.02, other_s=0.0)
    assert c._interval == 64
    for _ in range(200):  # the drafter becomes cheap and always accepted: the next probe wins
        g = c.next_gamma()
        c.update(gamma=g, accepted=g, draft_s=g * 0.0005, target_s=0.02, other_s=0.0)
    assert c.next_gamma() == 1 and c._interval == 4


def test_a_probe_capped_to_no_draft_doubles_the_interval_and_does_not_jump_to_the_longest():
    """A probe round that drafted nothing (a server's cap cut it to γ = 0) measured no drafted
    token, so it cannot show drafting hopeless: it loses like any probe and the interval doubles
    (pass cost exactly proportional to rows, no overhead: a free drafted token would only tie)."""
    c = CostGamma(probe_every=2, max_probe_every=128)
    c.update(gamma=1, accepted=0, draft_s=2.0, target_s=2.0, other_s=0.0)
    assert c.next_gamma() == 0
    c.update(gamma=0, accepted=0, draft_s=0.0, target_s=1.0, other_s=0.0)  # completes the interval
    assert c.next_gamma() == c.probe_gamma and c._probing  # a probe is scheduled
    c.update(gamma=0, accepted=0, draft_s=0.0, target_s=1.0, other_s=0.0)  # ... and capped to 0
    assert c._interval == 4


@pytest.mark.parametrize("idle", [False, True])
def test_probes_draft_probe_gamma_tokens(idle):
    """A probe drafts ``probe_gamma`` tokens (here 2), after backing off and after start_idle."""
    c = CostGamma(probe_gamma=2, probe_every=4, max_probe_every=4)
    if idle:
        c.start_idle()
    seen = []
    for _ in range(40):
        g = c.next_gamma()
        seen.append(g)
        c.update(gamma=g, accepted=0, draft_s=g * 0.03, target_s=0.02, other_s=0.0)
    probes = [g for g in seen[1:] if g > 0]  # (a fresh controller's first round drafts ``start``)
    assert probes and probes[0] == 2 and set(probes) == {2}, seen


def test_tree_budget_on_the_chain_drafts_the_chains_gamma():
    """On the chain arm the budget's γ is its cost controller's (a fresh one starts at 1, not 0)."""
    budget = TreeBudget(chain=CostGamma(start=3))
    assert not budget.tree_round and budget.next_gamma() == 3


def test_tree_rounds_do_not_teach_the_chain_controller():
    """Only chain rounds update the chain's γ controller: a tree round's accepted length and costs
    belong to the tree arm (a tree of 4 nodes fully accepted must not raise the chain's acceptance)."""
    budget = TreeBudget(warmup=1, probe_every=1, max_probe_every=1)
    budget.update(gamma=budget.next_gamma(), accepted=0, draft_s=0.001, target_s=0.02, other_s=0.0)
    assert budget.tree_round  # the probe of the smallest tree
    before = (list(budget.chain._tries), list(budget.chain._hits), budget.chain._target_s.copy(), budget.chain._draft_s)
    budget.update(gamma=budget.next_gamma(), accepted=4, draft_s=0.004, target_s=0.03, other_s=0.0)
    after = (list(budget.chain._tries), list(budget.chain._hits), budget.chain._target_s.copy(), budget.chain._draft_s)
    assert after == before


def test_a_carried_probe_is_judged_as_a_probe_by_the_successor():
    """A successor that inherits a scheduled probe judges that round as a probe: a losing probe
    moves the probe interval on (here from 2: a drafted token at a whole plain pass's cost is
    hopeless, so to the longest); not judged, the interval would stay at 2."""
    c = CostGamma(probe_every=2, max_probe_every=128)
    c.update(gamma=1, accepted=0, draft_s=2.0, target_s=2.0, other_s=0.0)
    c.update(gamma=0, accepted=0, draft_s=0.0, target_s=1.0, other_s=0.0)
    assert c._probing and c._interval == 2
    nxt = c.successor()
    assert nxt._draft_s == c._draft_s and nxt.next_gamma() == c.probe_gamma  # carried, probe first
    nxt.update(gamma=1, accepted=0, draft_s=2.0, target_s=2.0, other_s=0.0)
    assert not nxt._probing and nxt._interval > 2


def test_guide_rule_ignores_a_round_that_drafted_nothing():
    """A round with γ = 0 (a cap of 0 around the guide rule) says nothing about acceptance: the
    rule keeps its γ and does not divide by zero."""
    g = GuideGamma(gamma=5)
    g.update(gamma=0, accepted=0, draft_s=0, target_s=0, other_s=0)
    assert g.next_gamma() == 5
    capped = CappedGamma(GuideGamma(gamma=5), cap=lambda want: 0)
    assert capped.next_gamma() == 0
    capped.update(gamma=0, accepted=0, draft_s=0, target_s=0, other_s=0)
    assert capped.inner.next_gamma() == 5


def test_an_observed_controller_can_be_copied():
    """ObservedGamma forwards unknown attributes to its inner controller, but not while it has none
    (copy / pickle look attributes up on a bare instance): a copy works and plays the same."""
    seen = []
    wrapped = ObservedGamma(FixedGamma(3), lambda gamma, accepted: seen.append((gamma, accepted)))
    for twin in (copy.copy(wrapped), copy.deepcopy(wrapped)):
        assert twin.next_gamma() == 3 and twin.name == "fixed(3)"


def test_best_gamma_takes_the_shortest_draft_among_equal_rates():
    """When drafting neither wins nor loses (acceptance 0, free drafting, flat pass cost), the
    smallest γ is chosen: no drafting, never the longest draft."""
    g, rates = best_gamma([0.0] * 4, 0.0, [1.0] * 5, 0.0)
    assert len(set(rates)) == 1 and g == 0
    g, rates = best_gamma([1.0, 0.0, 0.0], 0.0, [1.0] * 4, 0.0)  # γ 1, 2 and 3 tie: 1 wins
    assert g == 1


def test_rounds_measured_at_zero_seconds_do_not_divide_by_zero():
    """A coarse clock (or a test's fake timings) can read a whole round as 0 s: the rates are taken
    over at least 1 ns, so γ is still chosen (by expected tokens), never a ZeroDivisionError."""

    g, rates = best_gamma([0.5, 0.25], 0.0, [0.0, 0.0, 0.0], 0.0)
    assert g == 2 and rates == pytest.approx([1e9, 1.5e9, 1.75e9])
    ctrl = CostGamma()
    for _ in range(5):
        ctrl.update(gamma=ctrl.next_gamma(), accepted=ctrl.next_gamma(), draft_s=0.0, target_s=0.0, other_s=0.0)
    assert ctrl.next_gamma() >= 1


def test_start_idle_restarts_the_probe_count():
    """start_idle waits the whole longest interval from the call, whatever count of plain rounds the
    controller had already run (a successor carries its count; the decoder then starts it idle)."""
    ctrl = CostGamma(max_probe_every=32)
    ctrl.start_idle()
    for _ in range(10):  # ten plain rounds already counted towards the first probe
        assert ctrl.next_gamma() == 0
        ctrl.update(gamma=0, accepted=0, draft_s=0.0, target_s=0.02, other_s=0.0)
    ctrl.start_idle()
    drafted = _idle_start_drafts(ctrl)
    assert drafted == [32], drafted


def test_a_free_round_does_not_teach_the_inner_controller():
    """update_free reports a free draft's round (prompt lookup's) to its own observer only: the
    inner γ controller, which sizes model drafts, does not learn from it."""
    free = []
    capped = CappedGamma(GuideGamma(gamma=5), cap=lambda want: None, observe_free=lambda g, a: free.append((g, a)))
    for _ in range(3):
        capped.update_free(gamma=5, accepted=5, draft_s=0.0, target_s=0.01, other_s=0.0)  # would grow γ to 8
    assert capped.next_gamma() == 5 and capped.inner.gamma == 5
    assert free == [(5, 5)] * 3
