from specdec.engine import make_gamma, parse_gamma
from specdec.errors import ConfigError
from specdec.gamma import CostGamma, FixedGamma, GuideGamma, best_gamma, expected_tokens

import pytest


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
    assert _run(CostGamma(), accept_rate=0.0, draft_s=0.002, target_s=0.02) in (0, 2)  # 2 = periodic probe
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
    assert 0 in seen and 2 in seen


def test_parse_gamma():
    assert parse_gamma("auto") == "auto" and parse_gamma("guide") == "guide" and parse_gamma("5") == 5
    for bad in ("0", "-1", "x", "1000"):
        with pytest.raises(ConfigError):
            parse_gamma(bad)
    assert isinstance(make_gamma(3), FixedGamma) and isinstance(make_gamma("auto"), CostGamma)
