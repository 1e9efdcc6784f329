"""Draft temperature calibration: the overlap it measures, the factor it chooses, the file it writes
and ``--draft-temperature-factor auto`` reading that file back."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.cli import main
from specdec.engine import CALIBRATION_FILE, Engine, EngineConfig
from specdec.models.toy import ToyLM
from specdec.train.calibrate import FACTORS, calibrate, choose, coupled_agreement, coupled_agreements, overlap
from tiny import make_tiny


def test_overlap_is_sum_of_min_p_q():
    lt = torch.tensor([[2.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    ld = torch.tensor([[0.0, 1.0, float("-inf")], [3.0, 0.0, 0.0]])
    for t, f in ((1.0, 1.0), (0.7, 0.85), (1.3, 0.5)):
        p, q = torch.softmax(lt / t, -1), torch.softmax(ld / (t * f), -1)
        want = torch.tensor([float(sum(min(a, b) for a, b in zip(p[i].tolist(), q[i].tolist()))) for i in range(2)])
        assert torch.allclose(overlap(lt, ld, t, f), want, atol=1e-6)
    assert overlap(lt, lt, 1.0, 1.0).tolist() == pytest.approx([1.0, 1.0])


def _agreement_by_definition(p: list[float], q: list[float]) -> float:
    """sum_x 1 / sum_v max(p_v / p_x, q_v / q_x) over the x both can draw, term by term."""
    return sum(1.0 / sum(max(pv / px, qv / qx) for pv, qv in zip(p, q)) for px, qx in zip(p, q) if px > 0 and qx > 0)


def test_coupled_agreement_is_the_chance_that_shared_gumbel_noise_picks_one_token():
    """Against the O(V^2) formula, and against the event itself: 200,000 shared Gumbel draws per row
    (the standard error of a frequency near 0.5 is ~0.0011; the tolerance is 0.006, over 5 SE),
    with tokens only one side can draw (-inf logits), ties in p / q, and q = p (agreement 1)."""
    gen = torch.Generator().manual_seed(3)
    lt = torch.randn(5, 9, generator=gen, dtype=torch.float64) * 2
    ld = torch.randn(5, 9, generator=gen, dtype=torch.float64) * 2
    lt[1, 2] = ld[1, 4] = ld[1, 5] = float("-inf")  # p = 0 at one token, q = 0 at two
    ld[2] = lt[2] + 0.7  # the same law: agreement 1 at factor 1
    ld[3, :4] = lt[3, :4]  # equal ratios p / q among the first four
    for t, f in ((1.0, 1.0), (0.7, 0.85)):
        got = coupled_agreement(lt, ld, t, f)
        p, q = torch.softmax(lt / t, -1), torch.softmax(ld / (t * f), -1)
        want = [_agreement_by_definition(p[i].tolist(), q[i].tolist()) for i in range(5)]
        assert got.tolist() == pytest.approx(want, rel=1e-9)
        assert (got <= overlap(lt, ld, t, f).double() + 1e-12).all()  # never above the maximal coupling
        g = -torch.log(-torch.log(torch.rand(200_000, 9, generator=gen, dtype=torch.float64)))
        for i in range(5):
            same = ((p[i].log() + g).argmax(-1) == (q[i].log() + g).argmax(-1)).double().mean()
            assert float(same) == pytest.approx(float(got[i]), abs=0.006), (i, t, f)
    assert float(coupled_agreement(lt, ld, 1.0, 1.0)[2]) == pytest.approx(1.0)
    reduced = ld.clone()
    reduced[:, 6:] = float("-inf")  # columns no row's draft can draw (a reduced draft vocabulary)
    p, q = torch.softmax(lt, -1), torch.softmax(reduced, -1)
    want = [_agreement_by_definition(p[i].tolist(), q[i].tolist()) for i in range(5)]
    assert coupled_agreement(lt, reduced, 1.0, 1.0).tolist() == pytest.approx(want, rel=1e-9)


def test_choose_takes_the_best_mean_and_breaks_ties_towards_one():
    sums = torch.tensor([[1.0, 3.0, 2.0], [2.0, 2.0, 2.2]])  # T = 1 over 4 positions, T = 0.7 over 2
    c = choose([1.0, 0.7], [0.8, 0.9, 1.0], sums, [4, 2])
    assert c.mean_overlap == {"1": [0.25, 0.75, 0.5], "0.7": [1.0, 1.0, 1.1]}
    assert c.factor == 0.9  # means over the temperatures: 0.625, 0.875, 0.8
    tie = choose([1.0], [0.8, 1.0, 1.2], torch.tensor([[5.0, 5.0, 5.0]]), [10])
    assert tie.factor == 1.0
    with pytest.raises(ValueError):
        choose([1.0], [1.0], torch.zeros(1, 1), [0])


class Flattened:
    """A draft whose logits are its target's times ``scale``: q at factor ``scale`` is exactly p."""

    def __init__(self, target: ToyLM, scale: float) -> None:
        self.target, self.scale = target, scale
        self.vocab_size, self.max_length = target.vocab_size, target.max_length

    def new_cache(self, max_length=None):  # noqa: ANN001, ANN201
        return self.target.new_cache(max_length)

    def forward(self, tokens, cache, *, last_only=False):  # noqa: ANN001, ANN201
        return self.target.forward(tokens, cache, last_only=last_only) * self.scale


@pytest.mark.parametrize("scale", [0.6, 0.85, 1.0, 1.15])
def test_calibration_recovers_a_known_flattening(scale):
    target = ToyLM(6, order=2, seed=5, scale=3.0)
    gen = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(0, 6, (24,), generator=gen), 3, i % 2) for i in range(6)]
    c = calibrate(target, Flattened(target, scale), seqs, [1.0, 0.7], FACTORS)
    assert c.factor == pytest.approx(scale)
    best = c.factors.index(c.factor)
    assert c.mean_overlap["1"][best] == pytest.approx(1.0, abs=1e-5)
    assert c.positions == {"1": 3 * 21, "0.7": 3 * 21} and c.sequences == 6
    assert c.mean_coupled_agreement is None  # measured only when asked for
    both = calibrate(target, Flattened(target, scale), seqs, [1.0, 0.7], FACTORS, coupled=True)
    assert both.factor == c.factor and both.mean_overlap == c.mean_overlap
    for t in ("1", "0.7"):  # q = p at the true factor: coupled drafts always agree there, and less elsewhere
        agree = both.mean_coupled_agreement[t]
        assert agree[best] == pytest.approx(1.0, abs=1e-5) and max(agree) == agree[best]
        assert all(a <= o + 1e-9 for a, o in zip(agree, both.mean_overlap[t]))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("cal") / "m", seed=3, max_positions=64)


def _err_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.startswith("specdec: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_the_command_writes_the_file_that_auto_reads(capsys, tiny_folder, tmp_path, monkeypatch):
    draft = tmp_path / "draft"
    import shutil

    # the draft loads as the target does on every CPU (with AVX2 but no VNNI, "auto" makes a draft's
    # layers 4-bit while this float folder's target is int8, and q would only be close to p)
    monkeypatch.setattr("specdec.engine.draft_quant", lambda cfg: "int8")

    shutil.copytree(tiny_folder, draft)
    code = main(["train", "calibrate", "--target", str(tiny_folder), "--draft", str(draft), "--out", str(draft),
                 "--prompts", "3", "--new-tokens", "5", "--temperatures", "1", "--factors", "0.8,1,1.25", "--coupled"])
    out, err = capsys.readouterr()
    assert code == 0, err
    saved = json.loads((draft / CALIBRATION_FILE).read_text())
    # the draft is its target (same weights): q = p at factor 1, so 1 wins with overlap 1
    assert saved["temperature_factor"] == 1.0 and saved["factors"] == [0.8, 1.0, 1.25]
    assert saved["mean_overlap"]["1"][1] == pytest.approx(1.0, abs=1e-4) and max(saved["mean_overlap"]["1"]) <= 1.0 + 1e-6
    assert saved["positions"]["1"] > 0 and saved["sequences"] == 3 and "| 1 | sum min(p, q) |" in out
    assert saved["mean_coupled_agreement"]["1"][1] == pytest.approx(1.0, abs=1e-4) and "| 1 | coupled |" in out
    assert all(a <= o + 1e-6 for a, o in zip(saved["mean_coupled_agreement"]["1"], saved["mean_overlap"]["1"]))
    # --draft-temperature-factor auto (the default) takes the folder's factor; a number overrides it
    (draft / CALIBRATION_FILE).write_text(json.dumps({**saved, "temperature_factor": 0.7}))
    target = Engine.build(EngineConfig(target=str(tiny_folder), draft="none")).target
    assert Engine.attach(target, EngineConfig(target=str(tiny_folder), draft=str(draft))).drafter.temperature_factor == 0.7
    both = Engine.attach(target, EngineConfig(target=str(tiny_folder), draft=f"{draft}+lookup", draft_temperature_factor="1.2"))
    assert both.drafter.temperature_factor == 1.2 and both.drafter.model.temperature_factor == 1.2
    plain = Engine.attach(target, EngineConfig(target=str(tiny_folder), draft=str(tiny_folder)))
    assert plain.drafter.temperature_factor == 1.0  # no calibration file: 1
    (draft / CALIBRATION_FILE).write_text(json.dumps({"temperature_factor": -1}))
    code = main(["generate", "-p", "hi", "--target", str(tiny_folder), "--draft", str(draft), "-n", "2"])
    assert code != 0 and "not a draft calibration" in _err_line(capsys.readouterr()[1])


@pytest.mark.parametrize("argv, says", [
    (["--factors", "0.8,x"], "--factors must be a comma list"),
    (["--temperatures", "0"], "--temperatures must be positive"),
    (["--factors", "0.5,200"], "temperature factor must be in"),
    (["--prompts", "0"], "--prompts must be 1-144"),
    (["--draft", "ngram"], "calibrate measures a draft model"),
    (["--draft", "layerskip:1"], "calibrate measures a draft model"),
    (["--out", "TMP/a-file/sub"], "cannot write to --out"),
])
def test_the_command_refuses_bad_input(capsys, tiny_folder, tmp_path, argv, says):
    (tmp_path / "a-file").write_text("x")
    argv = [a.replace("TMP", str(tmp_path)) for a in argv]
    code = main(["train", "calibrate", "--target", str(tiny_folder), "--draft", str(tiny_folder), "--out", str(tmp_path), *argv])
    assert code != 0 and says in _err_line(capsys.readouterr()[1])


@pytest.mark.parametrize("value, says", [("abc", "must be auto or a number"), ("0", "must be in (0, 100]"),
                                         ("-1", "must be in"), ("inf", "must be in"), ("101", "must be in")])
def test_generate_refuses_a_bad_factor(capsys, tiny_folder, value, says):
    code = main(["generate", "-p", "hi", "--target", str(tiny_folder), "--draft", str(tiny_folder), "-n", "2",
                 "--draft-temperature-factor", value])
    assert code != 0 and says in _err_line(capsys.readouterr()[1])


def test_a_factor_for_a_drafter_without_a_model_is_refused(capsys, tiny_folder):
    code = main(["generate", "-p", "hi", "--target", str(tiny_folder), "--draft", "ngram", "-n", "2",
                 "--draft-temperature-factor", "0.8"])
    assert code != 0 and "drafts without a model" in _err_line(capsys.readouterr()[1])


def test_the_factor_is_the_best_mean_over_temperatures_not_the_best_single_one():
    """Factor 0.8 is best at T = 1 alone (0.9), but 1.0 has the higher mean (0.55 against 0.5)."""
    c = choose([1.0, 0.7], [0.8, 1.0], torch.tensor([[0.9, 0.5], [0.1, 0.6]]), [1, 1])
    assert c.factor == 1.0


@pytest.mark.parametrize("temperature, factor", [(0.0, 1.0), (1.0, 0.0), (-1.0, 1.0)])
def test_a_temperature_or_factor_that_is_not_positive_is_refused(temperature, factor):
    logits = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="must be positive"):
        overlap(logits, logits, temperature, factor)
    with pytest.raises(ValueError, match="must be positive"):
        coupled_agreement(logits, logits, temperature, factor)


def test_a_sequence_without_a_continuation_is_skipped_but_counted():
    target = ToyLM(6, order=2, seed=5, scale=3.0)
    seqs = [(torch.arange(6) % 6, 6, 0), (torch.arange(8) % 6, 3, 0)]
    ticks = []
    c = calibrate(target, target, seqs, [1.0], (0.9, 1.0), ticks.append)
    assert c.positions == {"1": 5} and c.sequences == 2 and sum(ticks) == 2 and c.factor == 1.0


def test_a_tie_up_to_rounding_noise_still_goes_to_the_factor_nearest_one():
    """The means 0.1 + 0.2 + 0.3 and 0.3 + 0.2 + 0.1 are equal, but not bitwise in float: the
    comparison is rounded, so the tie still breaks towards factor 1, not to the float noise."""
    sums = torch.tensor([[0.3, 0.1], [0.2, 0.2], [0.1, 0.3]], dtype=torch.float64)  # factor 1.0 | factor 1.2
    noisy = sums.mean(0)
    assert float(noisy[0]) != float(noisy[1])  # the float noise this test is about
    c = choose([1.0, 0.8, 0.6], [1.0, 1.2], sums, [1, 1, 1])
    assert c.factor == 1.0


def test_the_coupled_table_divides_each_temperature_by_its_own_positions():
    """Sequences at T = 1 and T = 0.7 of different lengths (21 and 9 scored positions each):
    the coupled agreement of a draft equal to its target is 1 at factor 1 for both temperatures."""
    target = ToyLM(6, order=2, seed=5, scale=3.0)
    gen = torch.Generator().manual_seed(0)
    seqs = [(torch.randint(0, 6, (24,), generator=gen), 3, 0), (torch.randint(0, 6, (12,), generator=gen), 3, 1)]
    c = calibrate(target, target, seqs, [1.0, 0.7], (0.9, 1.0), coupled=True)
    assert c.positions == {"1": 21, "0.7": 9}
    for t in ("1", "0.7"):
        assert c.mean_coupled_agreement[t][1] == pytest.approx(1.0, abs=1e-5), t
        assert all(0.0 <= a <= 1.0 + 1e-9 for a in c.mean_coupled_agreement[t])


def test_any_factor_that_is_not_positive_is_refused_among_several():
    """One bad factor in a list (not only a list of bad ones) is a ValueError, not inf / nan."""
    logits = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="must be positive"):
        coupled_agreements(logits, logits, 1.0, [1.0, 0.0])
    with pytest.raises(ValueError, match="must be positive"):
        coupled_agreements(logits, logits, 1.0, [-0.5, 1.0])


def test_one_temperature_without_positions_is_refused_even_if_others_have_some():
    """A temperature with no scored position has no mean: a ValueError, not a nan in the table."""
    with pytest.raises(ValueError, match="at least one scored position"):
        choose([1.0, 0.7], [1.0], torch.tensor([[2.0], [0.0]]), [4, 0])


def test_the_mean_overlap_table_keeps_six_decimals() -> None:
    """``mean_overlap`` is sums / positions rounded to 6 places (what the file and the printed table show)."""
    c = choose([1.0], [0.9, 1.0], torch.tensor([[1.0, 2.0]], dtype=torch.float64), [3])
    assert c.mean_overlap == {"1": [0.333333, 0.666667]}
    assert c.positions == {"1": 3}


def test_each_temperature_is_continued_from_its_own_seed_and_scored_from_its_first_new_token(
        capsys, tiny_folder, tmp_path, monkeypatch):
    """Temperature i is sampled with seed --seed + i (its own random stream), each sequence is
    handed to the scorer with its first continuation position (the prompt's length) and the index
    of the temperature it was sampled at."""
    from specdec.train import calibrate as cal
    from specdec.train import kangaroo as kt

    seeds, got = [], {}
    real_continue, real_calibrate = kt.continue_batched, cal.calibrate

    def continue_batched(model, prompts, **kw):
        seeds.append((kw["seed"], tuple(kw["temperatures"])))
        got.setdefault("prompts", [list(p) for p in prompts])
        return real_continue(model, prompts, **kw)

    def calibrate(target, draft, seqs, temps, factors, **kw):
        got["seqs"], got["temps"] = list(seqs), list(temps)
        return real_calibrate(target, draft, seqs, temps, factors, **kw)

    monkeypatch.setattr(kt, "continue_batched", continue_batched)
    monkeypatch.setattr(cal, "calibrate", calibrate)
    code = main(["train", "calibrate", "--target", str(tiny_folder), "--draft", str(tiny_folder),
                 "--out", str(tmp_path / "o"), "--prompts", "2", "--new-tokens", "3", "--temperatures", "1,0.7",
                 "--factors", "1", "--seed", "5"])
    assert code == 0, capsys.readouterr().err
    assert seeds == [(5, (1.0,)), (6, (0.7,))]
    prompts, seqs = got["prompts"], got["seqs"]
    assert [ti for _, _, ti in seqs] == [0, 0, 1, 1]
    for i, (seq, start, _) in enumerate(seqs):
        prompt = prompts[i % 2]
        assert start == len(prompt) and seq[:start].tolist() == prompt and seq.numel() > start
