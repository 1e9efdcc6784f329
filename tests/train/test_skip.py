"""The skip-set search (``specdec train skip``) on a tiny random native model."""

from __future__ import annotations

import pytest

from specdec.drafters.self_spec import LayerPlan
from specdec.train.skip import CostModel, acceptance, build_calibration, expected_speedup, greedy_search, score
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
    from specdec.train.skip import local_search, singles_order

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
