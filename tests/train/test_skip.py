"""The skip-set search (``specdec train skip``) on a tiny random native model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from specdec.drafters.self_spec import LayerPlan
from specdec.train import skip as sk
from specdec.train.skip import (CostModel, SearchResult, acceptance, build_calibration, expected_speedup, greedy_search,
                                local_search, score, singles_order)
from drafters.test_self_spec import tiny_native

MODEL = tiny_native(layers=3, batch_invariant=False)
COST = CostModel(attn=0.1, mlp=0.15, fixed=0.25, verify_slope=0.1)


@pytest.fixture(scope="module")
def data():
    return build_calibration(MODEL, [[1, 2, 3], [0, 4], [3, 3, 1, 2]], new_tokens=8)


def test_expected_speedup_closed_form():
    assert expected_speedup(0.0, 0.3, COST) == (1.0, 0)  # nothing is ever accepted: do not draft
    s, g = expected_speedup(1.0, 0.0, COST)  # free, perfect draft: the longest γ
    assert g == 8 and s == pytest.approx(9 / (1 + 0.1 * 8))
    s, g = expected_speedup(0.0, 0.3, COST, floor=False)  # unfloored: the best losing γ, for the search to climb on
    assert g == 1 and s == pytest.approx(1 / (0.3 + 1.1))
    s, g = expected_speedup(0.8, 0.2, COST)
    assert s == pytest.approx(max((1 - 0.8 ** (k + 1)) / 0.2 / (0.2 * k + 1 + 0.1 * k) for k in range(1, 9)))
    assert COST.draft_cost(LayerPlan.skipping(3, set(), set())) == pytest.approx(0.25 + 3 * 0.25)
    assert COST.draft_cost(LayerPlan.skipping(3, {0, 1}, {2})) == pytest.approx(0.25 + 0.1 + 2 * 0.15)


def test_the_full_model_agrees_with_itself(data):
    a0, a1 = acceptance(MODEL, LayerPlan.skipping(3, set(), set()), data)
    assert a0 == 1.0 and a1 == pytest.approx(1.0, abs=1e-5)
    b0, b1 = acceptance(MODEL, LayerPlan.skipping(3, {0, 1, 2}, {0, 1, 2}), data)
    assert b0 < 1.0 and b1 < 0.999


def test_search_improves_on_nothing_skipped_and_resumes(data):
    state: dict = {}
    seen = []
    res = greedy_search(MODEL, data, COST, state=state, progress=lambda what, best: seen.append(what))
    base = score(MODEL, LayerPlan.skipping(3, set(), set()), data, COST)
    assert res.objective >= base.objective
    assert len(state["singles"]) == 6 and seen[:6] == [f"alone {k}{i}" for k in ("attn", "mlp") for i in range(3)]
    again = greedy_search(MODEL, data, COST, state=state)  # resumed: the single scores are not recomputed
    assert again.plan == res.plan and again.evaluations < res.evaluations
    short = greedy_search(MODEL, data, COST, max_steps=1)
    assert short.evaluations == 6 + 1


def test_influence_ranking_scores_every_sub_layer_in_one_pass(data):
    from specdec.train.skip import influence

    inf = influence(MODEL, data)
    assert set(inf) == {f"{k}{i}" for k in ("attn", "mlp") for i in range(3)}
    assert all(0.0 <= v <= 2.0 for v in inf.values()) and len(set(inf.values())) == 6
    state: dict = {}
    res = greedy_search(MODEL, data, COST, state=state, rank="influence")
    assert "singles" not in state and state["influence"] == inf
    assert res.objective >= score(MODEL, LayerPlan.skipping(3, set(), set()), data, COST).objective
    with pytest.raises(ValueError, match="rank"):
        greedy_search(MODEL, data, COST, rank="random")


def test_parameter_count_costs_add_up():
    cost = CostModel.from_params(MODEL.cfg)
    n = MODEL.cfg.n_layers
    assert cost.fixed + n * (cost.attn + cost.mlp) == pytest.approx(1.0)
    assert cost.mlp == pytest.approx(3 * 16 * 32 / (n * (48 * 16 + 3 * 16 * 32) + 5 * 16))


def test_acceptance_scores_the_view_as_it_drafts_over_the_targets_cache(data):
    """The scored logits are those the drafter bound to the target's cache drafts from: at every
    scored position its first draft token's law (T = 1) is their softmax, and its cache holds the
    target's keys; a view over a cache of its own (the old scoring) reads other logits."""
    import torch

    from specdec.drafters.base import DraftSampler
    from specdec.drafters.self_spec import LayerView, SelfSpecDrafter
    from specdec.sampling import SamplingConfig
    from specdec.train.skip import view_logits

    plan = LayerPlan.skipping(3, {1}, {0})
    seq, start, k, v = data.sequences[2], data.starts[2], data.keys[2], data.values[2]
    got = view_logits(MODEL, plan, seq, start, k, v)  # [n, V]
    assert got.shape[0] == seq.numel() - 1 - start
    own = LayerView(MODEL, plan).forward(seq, LayerView(MODEL, plan).new_cache(seq.numel()))[start:-1]
    assert not torch.allclose(own, got)
    cfg = SamplingConfig(temperature=1.0)
    for t in range(start, seq.numel() - 1):
        cache = MODEL.new_cache(seq.numel())
        MODEL.forward(seq[:t], cache)  # the committed positions but the last context token's
        drafter = SelfSpecDrafter(LayerView(MODEL, plan))
        drafter.bind_target(MODEL, cache)
        drafter.prepare(seq[: t + 1])
        draft = drafter.propose(seq[: t + 1], 1, DraftSampler(cfg, "multinomial", penalties=None, generator=torch.Generator()))
        assert torch.allclose(draft.probs[0], torch.softmax(got[t - start], -1), atol=1e-6), t  # q: the draft's law
        assert drafter.cache.length == t + 1 and torch.equal(drafter.cache.k[0, :, :t], cache.k[0, :, :t])


def test_a_reduced_vocabulary_is_scored_and_costed_as_the_view_drafts_through_it():
    """With a reduced draft vocabulary (``--draft-vocab auto``), the scored logits are those the
    bound view drafts from through its reduced head (T = 1 law: -inf, so probability 0, off the
    vocabulary), acceptance counts their arg-max, and the parameter costs count the head's rows
    the view computes."""
    import torch

    from specdec.drafters.base import DraftSampler
    from specdec.drafters.self_spec import LayerView, SelfSpecDrafter
    from specdec.sampling import SamplingConfig
    from specdec.train.skip import view_logits
    from drafters.test_self_spec import KEEP, TIED

    reduced = TIED.reduced_head(KEEP)
    data = build_calibration(TIED, [[1, 2, 3], [0, 4, 4, 1]], new_tokens=8)
    plan = LayerPlan.skipping(3, {1}, {0})
    agree = count = 0
    cfg = SamplingConfig(temperature=1.0)
    for seq, start, amax, k, v in zip(data.sequences, data.starts, data.target_argmax, data.keys, data.values):
        got = view_logits(TIED, plan, seq, start, k, v, reduced)  # [n, V]
        assert bool(torch.isinf(got[:, [1, 3]]).all())
        agree += int((got.argmax(-1) == amax).sum())
        count += amax.numel()
        for t in range(start, seq.numel() - 1):
            cache = TIED.new_cache(seq.numel())
            TIED.forward(seq[:t], cache)
            drafter = SelfSpecDrafter(LayerView(TIED, plan, reduced=reduced))
            drafter.bind_target(TIED, cache)
            drafter.prepare(seq[: t + 1])
            sampler = DraftSampler(cfg, "multinomial", penalties=None, generator=torch.Generator())
            draft = drafter.propose(seq[: t + 1], 1, sampler)
            assert torch.allclose(draft.probs[0], torch.softmax(got[t - start], -1), atol=1e-6), t
    assert acceptance(TIED, plan, data, reduced)[0] == agree / count
    assert acceptance(TIED, plan, data, reduced) != acceptance(TIED, plan, data)  # the head matters here
    assert CostModel.from_params(TIED.cfg, head_share=0.6).fixed == pytest.approx(0.6 * CostModel.from_params(TIED.cfg).fixed)


def test_local_search_ends_where_no_single_toggle_pays(data):
    """From every sub-layer skipped (a poor set), hill climbing raises the objective and, after a
    pass that changes nothing, no sub-layer toggled alone scores higher; from the greedy search's
    set it never scores lower than that set."""

    n = MODEL.cfg.n_layers
    worst = LayerPlan.skipping(n, set(range(n)), set(range(n)))
    res = local_search(MODEL, data, COST, worst, passes=20)
    assert res.objective > score(MODEL, worst, data, COST).objective
    for kind in ("attn", "mlp"):
        for i in range(n):
            attn, mlp = set(res.plan.skip_attn), set(res.plan.skip_mlp)
            (attn if kind == "attn" else mlp).symmetric_difference_update({i})
            assert score(MODEL, LayerPlan.skipping(n, attn, mlp), data, COST).objective <= res.objective, (kind, i)
    state: dict = {}
    greedy = greedy_search(MODEL, data, COST, state=state)
    order = singles_order(state, n)
    assert order is not None and sorted(order) == sorted([("attn", i) for i in range(n)] + [("mlp", i) for i in range(n)])
    assert singles_order({}, n) is None
    assert local_search(MODEL, data, COST, greedy.plan, order=order).objective >= greedy.objective


def test_the_command_starts_over_on_other_calibration_prompts(tmp_path, capsys):
    """The search state beside --out holds scores of one calibration set: a rerun with other prompts
    or another token count reused them (a different search, recorded as the new command); it now
    says so and starts over. A cut-short state file is a one-line error naming it."""
    from specdec.cli import main
    from tiny import make_tiny

    target = make_tiny(tmp_path / "target", seed=0, layers=2, max_positions=256)
    out = tmp_path / "s" / "plan.json"
    base = ["train", "skip", "--target", str(target), "--out", str(out), "--cost", "params", "--max-steps", "1"]
    assert main([*base, "--prompts", "2", "--new-tokens", "4"]) == 0
    capsys.readouterr()
    assert main([*base, "--prompts", "2", "--new-tokens", "4"]) == 0  # the same: resumed, nothing said
    assert "starting over" not in capsys.readouterr().err
    assert main([*base, "--prompts", "3", "--new-tokens", "4"]) == 0
    assert "holds a search on another target or other calibration prompts: starting over" in capsys.readouterr().err
    state = out.with_name(out.name + ".state.json")
    state.write_text(state.read_text()[:20])
    assert main([*base, "--prompts", "3", "--new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "plan.json.state.json cannot be read" in err and "Traceback" not in err


N = MODEL.cfg.n_layers  # 3


#: acceptance lost when a sub-layer is skipped alone, at T = 0 and T = 1: by their mean the order is
#: mlp0, attn0, attn1, mlp1, attn2, mlp2 (by T = 0 alone it would start attn1, attn0)
HARM0 = {"attn0": 0.05, "attn1": 0.01, "attn2": 0.3, "mlp0": 0.05, "mlp1": 0.2, "mlp2": 0.4}
HARM1 = {"attn0": 0.05, "attn1": 0.2, "attn2": 0.3, "mlp0": 0.0, "mlp1": 0.2, "mlp2": 0.4}


def _names(plan: LayerPlan) -> frozenset[str]:
    return frozenset({f"attn{i}" for i in plan.skip_attn} | {f"mlp{i}" for i in plan.skip_mlp})


def _fake_score(objective, tilt=lambda s: 0.0):
    """A score whose α's come from HARM0/HARM1 and whose T = 0 / T = 1 speed-ups are
    objective(set) ± tilt(set) (so the search's objective, their mean, is objective(set))."""
    def fake(target, plan, data, cost, evaluations=0, reduced=None):
        s = _names(plan)
        a0 = 1 - sum(HARM0[k] for k in s)
        a1 = 1 - sum(HARM1[k] for k in s)
        x, d = objective(s), tilt(s)
        return SearchResult(plan, a0, a1, 0.0, x + d, x - d, 1, 1, evaluations, cost)

    return fake


def test_greedy_search_grows_the_harmless_first_keeps_the_best_prefix_and_prunes_it(monkeypatch) -> None:
    """Order: by the mean of α₀ and α₁ lost alone, most harmless first; the objective dips at one
    skip, peaks at two (a tie at three is not better), and `patience` misses after the peak end
    the growth (the fifth prefix, better still, is never tried); the removal pass then finds that
    running mlp0 again pays.  Under ``max_steps`` there is no removal pass."""
    by_size = {0: 1.0, 1: 0.9, 2: 1.3, 3: 1.3, 4: 1.2, 5: 1.5, 6: 1.5}
    objective = lambda s: 1.4 if s == {"attn0"} else by_size[len(s)]  # noqa: E731
    tilt = lambda s: 0.6 if s == {"mlp0"} else 0.0  # noqa: E731  (T = 0 alone would keep {mlp0})
    monkeypatch.setattr(sk, "score", _fake_score(objective, tilt))
    seen: list[str] = []
    res = greedy_search(MODEL, None, COST, patience=2, progress=lambda what, best: seen.append(what))
    assert seen[:6] == [f"alone {k}{i}" for k in ("attn", "mlp") for i in range(N)]
    assert seen[6:] == ["add mlp0", "add attn0", "add attn1", "add mlp1", "drop attn0", "drop mlp0"]
    assert _names(res.plan) == {"attn0"} and res.objective == pytest.approx(1.4)
    assert res.evaluations == 6 + 4 + 2
    short = greedy_search(MODEL, None, COST, max_steps=2, patience=2)
    assert _names(short.plan) == {"mlp0", "attn0"}


def test_influence_ranking_orders_by_influence_per_unit_of_cost_saved(monkeypatch) -> None:
    """``rank="influence"``: the least influence per unit of draft cost saved goes first (attention
    and MLP sub-layers cost differently)."""
    inf = {"attn0": 0.1, "attn1": 0.3, "attn2": 0.5, "mlp0": 0.2, "mlp1": 0.05, "mlp2": 0.8}
    monkeypatch.setattr(sk, "influence", lambda target, data: dict(inf))
    monkeypatch.setattr(sk, "score", _fake_score(lambda s: float(len(s))))  # every skip pays: all six are added
    seen: list[str] = []
    cost = CostModel(attn=0.1, mlp=0.2, fixed=0.25)
    greedy_search(MODEL, None, cost, rank="influence", progress=lambda what, best: seen.append(what))
    # influence / cost: mlp1 0.25, attn0 1, mlp0 1, attn1 3, mlp2 4, attn2 5
    assert [w for w in seen if w.startswith("add")] == [f"add {k}" for k in ("mlp1", "attn0", "mlp0", "attn1", "mlp2", "attn2")]


def test_local_search_passes_toggle_each_sub_layer_once_and_stop_after_a_quiet_pass(monkeypatch) -> None:
    """A pass toggles each of the 2n sub-layers once, keeping only strict improvements (a tie is
    not taken); the search stops after the first pass that changes nothing, or after ``passes``."""
    monkeypatch.setattr(sk, "score", _fake_score(lambda s: 2.0 if s == {"mlp1"} else 1.0))
    start = LayerPlan.skipping(N, set(), set())
    res = local_search(MODEL, None, COST, start, passes=5)
    assert _names(res.plan) == {"mlp1"} and res.evaluations == 1 + 2 * (2 * N)  # one pass that pays, one quiet one
    one = local_search(MODEL, None, COST, start, passes=1)
    assert _names(one.plan) == {"mlp1"} and one.evaluations == 1 + 2 * N
    monkeypatch.setattr(sk, "score", _fake_score(lambda s: 1.0))  # everything ties: nothing is ever kept
    flat = local_search(MODEL, None, COST, start, passes=5)
    assert _names(flat.plan) == frozenset() and flat.evaluations == 1 + 2 * N


def test_a_score_reports_the_losing_speed_up_unfloored() -> None:
    """The search climbs on the best γ >= 1 even where it loses: a score of a draft that costs
    more than the target step reports that speed-up (< 1) and its γ, not ×1 at γ = 0."""
    dear = CostModel(attn=0.3, mlp=0.3, fixed=0.25, verify_slope=0.1)
    data = sk.build_calibration(MODEL, [[1, 2, 3], [0, 4]], new_tokens=4)
    res = score(MODEL, LayerPlan.skipping(N, set(), set()), data, dear)
    assert res.alpha0 == 1.0
    assert res.gamma0 >= 1 and res.gamma1 >= 1
    assert res.speedup0 < 1.0 and res.speedup1 < 1.0


class _Cache:
    def truncate(self, n):
        pass


def _fake_costs(monkeypatch, *, fixed: float = 0.25, attn: float = 0.125, mlp: float = 0.25, verify: float = 1.4,
                view_fixed: float | None = None, reduced=None, max_length: int = 256, context: int = 8,
                repeats: int = 3, outlier_at: int | None = None):
    """measure_costs on a hand-moved clock: a one-token step costs ``fixed`` + ``attn`` per attention
    + ``mlp`` per MLP sub-layer (two layers), a view's ``view_fixed`` in place of ``fixed`` where
    given, a 5-position verification ``verify`` target steps, and the ``outlier_at``-th one-token
    target step half its time.  Returns the costs and the prefill lengths the target and views ran."""
    clock = [0.0]
    prefills: list[int] = []
    target_steps = [0]

    def step(plan_steps):
        return fixed + sum(attn * a + mlp * m for _, a, m in plan_steps)

    full = step([(i, True, True) for i in range(2)])

    class Target:
        cfg = SimpleNamespace(n_layers=2)
        vocab_size = 50

        def __init__(self):
            self.max_length = max_length

        def new_cache(self, n):
            return _Cache()

        def forward(self, tokens, cache):
            if tokens.numel() == 1:
                target_steps[0] += 1
                clock[0] += full * (0.5 if target_steps[0] == outlier_at else 1.0)
            elif tokens.numel() == 5:
                clock[0] += full * verify
            else:
                prefills.append(tokens.numel())

    class View:
        def __init__(self, target, plan, reduced=None):
            self.plan = plan

        def new_cache(self, n):
            return _Cache()

        def forward(self, tokens, cache):
            if tokens.numel() == 1:
                clock[0] += step(self.plan.steps) + ((view_fixed - fixed) if view_fixed is not None else 0.0)
            else:
                prefills.append(tokens.numel())

    monkeypatch.setattr(sk, "LayerView", View)
    monkeypatch.setattr(sk, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    return sk.measure_costs(Target(), repeats=repeats, context=context, reduced=reduced), prefills


def test_measured_costs_are_per_sub_layer_shares_of_a_target_step(monkeypatch) -> None:
    """On a clock where a step costs 0.2 fixed + 0.1 per attention + 0.15 per MLP sub-layer (two
    layers: 0.7) and a 5-position verification 1.4 steps: each attention costs 0.1 / 0.7 of a
    target step, each MLP 0.15 / 0.7, the rest 0.2 / 0.7, and v(γ) = 1 + 0.1 γ."""
    cost, _ = _fake_costs(monkeypatch, fixed=0.2, attn=0.1, mlp=0.15)
    assert cost.attn == pytest.approx(0.1 / 0.7) and cost.mlp == pytest.approx(0.15 / 0.7)
    assert cost.fixed == pytest.approx(0.2 / 0.7) and cost.verify_slope == pytest.approx(0.1)


def test_influence_is_measured_on_the_stream_each_sub_layer_receives(data) -> None:
    """ShortGPT's block influence of the last MLP sub-layer: 1 − cos between the residual stream
    entering it (after every sub-layer before it) and leaving it, averaged over all positions."""
    import torch

    from specdec.train.skip import influence

    got = influence(MODEL, data)["mlp2"]
    total = count = 0.0
    with torch.inference_mode():
        for seq in data.sequences:
            cache = MODEL.new_cache(seq.numel())
            cache.reserve(seq.numel())
            before = [(i, True, True) for i in range(N - 1)] + [(N - 1, True, False)]
            x = MODEL.run_layers(MODEL.embed_tokens(seq), cache, before, start=0)
            y = MODEL.run_layers(x, cache, ((N - 1, False, True),), start=0)
            total += float((1.0 - torch.cosine_similarity(x, y, dim=-1)).sum())
            count += seq.numel()
    assert got == pytest.approx(total / count, rel=1e-4)


def test_a_measured_fixed_cost_is_floored_at_two_percent_of_a_step(monkeypatch) -> None:
    """Where the sub-layers account for the whole step (no time left for the head and overhead),
    the fixed cost is floored at 0.02 of a target step, so a draft that skips everything is never
    free (a free draft would make the search's objective run away to the longest γ)."""
    cost, _ = _fake_costs(monkeypatch, fixed=0.0, attn=0.125, mlp=0.25)
    assert cost.attn == pytest.approx(0.125 / 0.75) and cost.mlp == pytest.approx(0.25 / 0.75)
    assert cost.fixed == pytest.approx(0.02)


def test_a_reduced_heads_fixed_cost_is_timed_through_the_views_head(monkeypatch) -> None:
    """With a reduced vocabulary the views' steps are timed through its (cheaper) head: the
    sub-layer shares come from view steps alone, and the fixed cost is the view's head and
    overhead (0.125 here) against the target's whole step (0.25 + 2 x (0.125 + 0.25) = 1.0)."""
    cost, _ = _fake_costs(monkeypatch, view_fixed=0.125, reduced=object())
    assert cost.attn == pytest.approx(0.125) and cost.mlp == pytest.approx(0.25)
    assert cost.fixed == pytest.approx(0.125)


def _table(values: dict, default: float = 0.5):
    return lambda s: values.get(frozenset(s), default)


def test_the_removal_pass_drops_from_the_set_it_has_kept_so_far(monkeypatch):
    """Growth keeps {mlp0, attn0, attn1} (order mlp0, attn0, attn1, ...; patience 1); the removal
    pass then drops attn0 (better), and each later drop is tried from that smaller set: dropping
    mlp0 from {mlp0, attn1} leaves {attn1}, the best of all — not from the grown set."""
    values = {frozenset(): 1.0, frozenset({"mlp0"}): 1.1, frozenset({"mlp0", "attn0"}): 1.2,
              frozenset({"mlp0", "attn0", "attn1"}): 1.3, frozenset({"mlp0", "attn1"}): 1.5,
              frozenset({"attn1"}): 1.6}
    monkeypatch.setattr(sk, "score", _fake_score(_table(values)))
    seen: list[str] = []
    res = greedy_search(MODEL, None, COST, patience=1, progress=lambda what, best: seen.append(what))
    assert [w for w in seen if w.startswith("drop")] == ["drop attn0", "drop attn1", "drop mlp0"]
    assert _names(res.plan) == {"attn1"} and res.objective == pytest.approx(1.6)


def test_the_removal_pass_keeps_a_sub_layer_skipped_on_a_tie(monkeypatch):
    """Running a skipped sub-layer again is kept only where the objective strictly rises: a drop
    that ties the grown set's objective leaves the set as grown."""
    values = {frozenset(): 1.0, frozenset({"mlp0"}): 1.1, frozenset({"mlp0", "attn0"}): 1.3,
              frozenset({"attn0"}): 1.3}
    monkeypatch.setattr(sk, "score", _fake_score(_table(values)))
    res = greedy_search(MODEL, None, COST, patience=1)
    assert _names(res.plan) == {"mlp0", "attn0"}


def test_from_params_keeps_the_verification_slope_it_is_given():
    """``--cost params`` with a measured or chosen slope: v(γ) = 1 + slope·γ carries that slope."""
    assert CostModel.from_params(MODEL.cfg, verify_slope=0.3).verify_slope == 0.3
    assert CostModel.from_params(MODEL.cfg).verify_slope == 0.12


def test_a_measured_step_is_the_median_of_its_repeats_not_the_fastest(monkeypatch):
    """Each step time is the median of ``repeats`` (3 here): one outlier at half the time (a
    fluke, not the step's cost) does not halve the target step every share is measured against."""
    cost, _ = _fake_costs(monkeypatch, outlier_at=2)
    assert cost.attn == pytest.approx(0.125) and cost.mlp == pytest.approx(0.25)
    assert cost.fixed == pytest.approx(0.25) and cost.verify_slope == pytest.approx(0.1)


def test_costs_are_measured_at_a_context_within_half_the_targets_length(monkeypatch):
    """The timing context is capped at half the target's ``max_length`` (room for the timed
    tokens): asked for 64 positions on a 20-position target, every model is prefilled with 10."""
    _, prefills = _fake_costs(monkeypatch, max_length=20, context=64)
    assert prefills and set(prefills) == {10}


def test_local_search_climbs_from_the_set_it_is_given(monkeypatch):
    """``local_search`` starts at ``start``: a start that no single toggle improves on comes back
    as it is (one pass of 2n toggles), even where climbing from nothing skipped would stop at an
    empty set (every single skip there scores the same)."""
    monkeypatch.setattr(sk, "score", _fake_score(_table({frozenset({"attn2", "mlp1"}): 3.0}, default=1.0)))
    start = LayerPlan.skipping(3, {2}, {1})
    res = sk.local_search(MODEL, None, COST, start, passes=3)
    assert _names(res.plan) == {"attn2", "mlp1"} and res.evaluations == 1 + 6


def test_an_influence_search_reuses_the_influence_its_state_holds(monkeypatch):
    """A resumed ``rank="influence"`` search takes the block influences from ``state`` (a
    checkpoint) instead of measuring them again, and orders by them."""
    inf = {"attn0": 0.1, "attn1": 0.3, "attn2": 0.5, "mlp0": 0.2, "mlp1": 0.05, "mlp2": 0.8}

    def measure(target, data):
        raise AssertionError("influence measured again")

    monkeypatch.setattr(sk, "influence", measure)
    monkeypatch.setattr(sk, "score", _fake_score(lambda s: float(len(s))))
    seen: list[str] = []
    greedy_search(MODEL, None, CostModel(attn=0.1, mlp=0.2, fixed=0.25), rank="influence", state={"influence": dict(inf)},
                  progress=lambda what, best: seen.append(what))
    assert [w for w in seen if w.startswith("add")][:2] == ["add mlp1", "add attn0"]


class _LengthCache:
    """A cache that only counts its positions, as a KVCache's length moves."""

    def __init__(self):
        self.length = 0

    def truncate(self, n):
        self.length = min(self.length, n)


def test_every_timed_step_runs_at_the_same_context(monkeypatch) -> None:
    """measure_costs times ``repeats`` steps at one ``context``-token position: the cache is cut
    back to ``context`` after each timed step, so no repeat runs at a longer context than the
    first (nor overruns the ``context + 16`` positions it asked for).  8 repeats, 2 layers."""
    seen: list[tuple[int, int]] = []  # (tokens, cache length before the step) per timed call

    def forward(tokens, cache):
        if tokens.numel() != 10:  # not the prefill
            seen.append((tokens.numel(), cache.length))
        cache.length += tokens.numel()

    class Target:
        cfg = SimpleNamespace(n_layers=2)
        vocab_size = 50
        max_length = 256

        def new_cache(self, n):
            return _LengthCache()

        def forward(self, tokens, cache):
            forward(tokens, cache)

    class View(Target):
        def __init__(self, target, plan, reduced=None):
            pass

    monkeypatch.setattr(sk, "LayerView", View)
    sk.measure_costs(Target(), repeats=8, context=10)
    assert len(seen) == 8 * 4  # target, no attention, no MLP, a 5-token verification
    assert {length for _, length in seen} == {10}
    assert {n for n, _ in seen} == {1, 5}




def _recording_score(objective, seen_reduced: list):
    """A score whose objective (both speed-ups) is ``objective(names)``, and whose α's make the
    single-skip order attn0, attn1, attn2, mlp0, mlp1, mlp2; records the ``reduced`` head it is given."""
    harm = {f"{k}{i}": 0.01 * (j + 1) for j, (k, i) in enumerate([(k, i) for k in ("attn", "mlp") for i in range(N)])}

    def fake(target, plan, data, cost, evaluations=0, reduced=None):
        seen_reduced.append(reduced)
        s = _names(plan)
        a = 1 - sum(harm[k] for k in s)
        x = objective(s)
        return SearchResult(plan, a, a, 0.0, x, x, 1, 1, evaluations, cost)

    return fake


def test_every_score_of_a_search_goes_through_the_reduced_head(monkeypatch) -> None:
    """``reduced`` (a reduced vocabulary's head) is passed on to every score: the single skips,
    the growing prefix, the removal pass (greedy_search) and every toggle (local_search) -- a
    score through the target's head would search for another draft than the one that runs."""
    head = object()
    seen: list = []
    monkeypatch.setattr(sk, "score", _recording_score(lambda s: 1.0 + 0.1 * len(s) - (0.5 if len(s) > 2 else 0.0), seen))
    res = greedy_search(MODEL, None, COST, patience=2, reduced=head)
    assert res.plan.skip_attn  # it kept something, so the removal pass ran
    assert len(seen) > 2 * N and all(r is head for r in seen)
    seen.clear()
    local_search(MODEL, None, COST, LayerPlan.skipping(N, {0}, set()), passes=2, reduced=head)
    assert len(seen) > 1 and all(r is head for r in seen)


def test_progress_reports_the_best_set_so_far_not_the_one_just_tried(monkeypatch) -> None:
    """The progress callback gets the best result so far (the command shows it as "best"): a
    prefix that scores below the empty set does not lower what is reported."""
    seen: list[tuple[str, float]] = []
    by_size = {0: 1.0, 1: 0.9, 2: 1.3, 3: 1.2, 4: 1.1, 5: 1.0, 6: 0.9}
    monkeypatch.setattr(sk, "score", _recording_score(lambda s: by_size[len(s)], []))
    greedy_search(MODEL, None, COST, patience=2, max_steps=4, progress=lambda what, best: seen.append((what, best.objective)))
    adds = [(w, o) for w, o in seen if w.startswith("add")]
    assert adds == [("add attn0", pytest.approx(1.0)), ("add attn1", pytest.approx(1.3)),
                    ("add attn2", pytest.approx(1.3)), ("add mlp0", pytest.approx(1.3))]


def test_a_search_cut_short_before_every_single_was_scored_has_no_singles_order() -> None:
    """singles_order needs every sub-layer's score: a state that holds only some (a search
    interrupted while scoring them) gives None, not a KeyError."""
    assert singles_order({"singles": {"attn0": 0.9, "mlp1": 0.8}}, 2) is None
    full = {"attn0": 0.9, "attn1": 0.7, "mlp0": 0.95, "mlp1": 0.8}
    assert singles_order({"singles": full}, 2) == [("mlp", 0), ("attn", 0), ("mlp", 1), ("attn", 1)]


def test_the_result_file_records_where_the_costs_came_from(tmp_path) -> None:
    """write_result records the cost source, rank and draft vocabulary it is given (a reader
    tells a parameter-count estimate from a timed one)."""
    import json

    plan = LayerPlan.skipping(N, {1}, set())
    res = SearchResult(plan, 0.9, 0.8, 0.7, 1.5, 1.4, 3, 2, 11, COST)
    out = tmp_path / "plan.json"
    sk.write_result(res, out, target="t", prompts=2, new_tokens=4, rank="influence", cost_source="params", draft_vocab=123)
    got = json.loads(out.read_text())
    assert got["cost_source"] == "params" and got["rank"] == "influence" and got["draft_vocab"] == 123
    assert got["evaluations"] == 11 and got["calibration"] == {"prompts": 2, "new_tokens": 4}


def test_singles_tied_in_score_come_attention_first_then_by_layer() -> None:
    """Sub-layers whose single-skip scores tie are ordered as the influence ranking orders its
    ties (attention before MLP, then by layer), so a resumed search and a fresh one (and the
    polish pass that takes this order) walk the same path."""
    tied = {"attn0": 0.5, "attn1": 0.5, "mlp0": 0.5, "mlp1": 0.5}
    assert singles_order({"singles": tied}, 2) == [("attn", 0), ("attn", 1), ("mlp", 0), ("mlp", 1)]


def test_a_cost_model_survives_its_json_round_trip() -> None:
    """The search state saves the cost model as to_json() and a resumed search rebuilds it with
    CostModel(**saved): every field, the verification slope included, comes back."""
    cost = CostModel(attn=0.11, mlp=0.17, fixed=0.3, verify_slope=0.05)
    assert CostModel(**cost.to_json()) == cost


def test_a_search_returns_its_best_sets_figures_each_in_its_place(monkeypatch) -> None:
    """greedy_search's and local_search's results carry the best set's α's, cost, speed-ups and
    γ's field for field (T = 0 and T = 1 are not swapped), with their own evaluation count."""
    def fake(target, plan, data, cost, evaluations=0, reduced=None):
        k = len(_names(plan))
        return SearchResult(plan, 0.9 - 0.01 * k, 0.8 - 0.01 * k, 0.5 - 0.05 * k, 1.0 + 0.1 * k, 1.2 + 0.1 * k,
                            2 + k, 7 + k, evaluations, cost)

    monkeypatch.setattr(sk, "score", fake)
    for res in (greedy_search(MODEL, None, COST, patience=2),
                local_search(MODEL, None, COST, LayerPlan.skipping(N, set(), set()), passes=1)):
        k = len(_names(res.plan))
        assert k > 0
        want = fake(None, res.plan, None, COST)
        assert (res.alpha0, res.alpha1, res.draft_cost, res.speedup0, res.speedup1, res.gamma0, res.gamma1) == \
            (want.alpha0, want.alpha1, want.draft_cost, want.speedup0, want.speedup1, want.gamma0, want.gamma1)
        assert res.cost is COST
