"""specdec/defaults.py is the one place for defaults: the command line's options default to its
values, the library's entry points (EngineConfig, Engine.generate) take the same ones, and what the
help and README say each default is matches the value."""

from __future__ import annotations

import inspect
from dataclasses import replace
from pathlib import Path

import pytest

from specdec import defaults
from specdec.errors import ConfigError
from specdec.sampling import SamplingConfig, validate

README = Path(__file__).resolve().parents[1] / "README.md"


def _generate_args(*argv):
    from specdec.cli import build_parser

    return build_parser().parse_args(["generate", "-p", "hi", *argv])


def _generate_help(capsys, monkeypatch) -> str:
    from specdec.cli import main

    monkeypatch.setenv("COLUMNS", "10000")  # one line per option: no wrapping inside a phrase

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_generate_option_defaults_are_the_defaults_modules():
    args = _generate_args()
    assert (args.target, args.draft, args.gamma, args.tree, args.kv_dtype, args.batch) == (
        defaults.DEFAULT_TARGET, defaults.DEFAULT_DRAFT, defaults.DEFAULT_GAMMA, defaults.DEFAULT_TREE,
        defaults.KV_DTYPE, defaults.BATCH_SEQUENCES)
    assert args.dtype == defaults.TARGET_DTYPE


def test_the_library_takes_the_same_defaults_as_the_command_line():
    from specdec.engine import Engine, EngineConfig

    cfg = EngineConfig()
    assert (cfg.target, cfg.draft, cfg.dtype, cfg.kv_dtype) == (
        defaults.DEFAULT_TARGET, defaults.DEFAULT_DRAFT, defaults.TARGET_DTYPE, defaults.KV_DTYPE)
    params = inspect.signature(Engine.generate).parameters
    assert params["gamma"].default == defaults.DEFAULT_GAMMA and params["tree"].default == defaults.DEFAULT_TREE


def test_the_documented_defaults_are_the_values():
    """What users are told: γ auto and a chain by default, guide γ start 6 / range 3-12, the preset
    'guide' = T 1.0 / top-p 0.9 / repetition penalty 1.1, seeds up to 2^63 - 1, batches of 16, a
    cache at its target's dtype, tree nodes below 0.15 left out, drafts not cut on confidence."""
    assert defaults.DEFAULT_GAMMA == "auto" and defaults.DEFAULT_TREE == "chain"
    assert (defaults.GUIDE_GAMMA_START, defaults.GUIDE_GAMMA_MIN, defaults.GUIDE_GAMMA_MAX) == (6, 3, 12)
    assert defaults.SAMPLING_PRESETS["guide"] == {"temperature": 1.0, "top_p": 0.9, "repetition_penalty": 1.1}
    assert defaults.SAMPLING_PRESETS["greedy"] == {"temperature": 0.0}
    assert defaults.MAX_SEED == 2**63 - 1
    assert defaults.BATCH_SEQUENCES == 16 and defaults.KV_DTYPE == "auto"
    assert defaults.TREE_MIN_PROB == 0.15 and defaults.MIN_CONFIDENCE == 0.0
    assert defaults.MAX_GAMMA == 64 and defaults.MAX_TREE_NODES == 64
    assert defaults.DEFAULT_DRAFT == "smollm2-135m-draft+lookup" and defaults.DEFAULT_TARGET == "smollm2-135m"


def test_the_help_states_the_defaults_as_defaults_py_has_them(capsys, monkeypatch):
    text = _generate_help(capsys, monkeypatch)
    g = defaults
    assert f"'guide' (start {g.GUIDE_GAMMA_START}, range {g.GUIDE_GAMMA_MIN}-{g.GUIDE_GAMMA_MAX})" in text
    assert f"'{g.DEFAULT_GAMMA}' (cost-based, default)" in text
    assert f"'{g.DEFAULT_TREE}' (default: one candidate per position)" in text
    guide = g.SAMPLING_PRESETS["guide"]
    assert (f"'guide' = T {guide['temperature']:.1f}, top-p {guide['top_p']:g}, repetition penalty "
            f"{guide['repetition_penalty']:g}") in text
    assert f"(default {g.TREE_MIN_PROB:g};" in text and f"(default {g.BATCH_SEQUENCES})" in text
    assert g.MAX_SEED == 2**63 - 1 and "0 .. 2^63 - 1" in text
    assert "(default 0 = off; lossless)" in text and g.MIN_CONFIDENCE == 0.0


def test_the_readme_states_the_defaults_as_defaults_py_has_them():
    text = " ".join(README.read_text().split())
    g = defaults
    assert f"start {g.GUIDE_GAMMA_START}, range {g.GUIDE_GAMMA_MIN}–{g.GUIDE_GAMMA_MAX}" in text
    assert f"`--tree-min-prob`, default {g.TREE_MIN_PROB:g}" in text
    assert f"`--batch` sequences (default {g.BATCH_SEQUENCES})" in text


def test_the_guide_gamma_rule_starts_and_stays_where_defaults_say():
    """--gamma guide: γ starts at GUIDE_GAMMA_START and stays within GUIDE_GAMMA_MIN..MAX."""
    from specdec.engine import make_gamma

    ctl = make_gamma("guide")
    assert ctl.next_gamma() == defaults.GUIDE_GAMMA_START
    for _ in range(40):  # every draft rejected: down to the floor, not below
        ctl.update(gamma=ctl.next_gamma(), accepted=0, draft_s=0.0, target_s=0.0, other_s=0.0)
    assert ctl.next_gamma() == defaults.GUIDE_GAMMA_MIN
    for _ in range(40):  # every draft accepted: up to the ceiling, not above
        g = ctl.next_gamma()
        ctl.update(gamma=g, accepted=g, draft_s=0.0, target_s=0.0, other_s=0.0)
    assert ctl.next_gamma() == defaults.GUIDE_GAMMA_MAX


def test_the_temperature_and_repetition_penalty_bounds_are_inclusive():
    base = SamplingConfig(temperature=1.0)
    for t in (1e-3, 1e4):
        validate(replace(base, temperature=t))
    for t in (0.9e-3, 1.1e4):
        with pytest.raises(ConfigError, match="temperature"):
            validate(replace(base, temperature=t))
    for p in (1e-3, 1e3):
        validate(replace(base, repetition_penalty=p))
    for p in (0.9e-3, 1.1e3):
        with pytest.raises(ConfigError, match="repetition penalty"):
            validate(replace(base, repetition_penalty=p))


def test_the_calibration_factors_run_from_half_to_one_point_two():
    assert defaults.CALIBRATION_FACTORS[0] == 0.5 and defaults.CALIBRATION_FACTORS[-1] == 1.2
    assert len(defaults.CALIBRATION_FACTORS) == 15 and 1.0 in defaults.CALIBRATION_FACTORS


def test_the_draft_seed_offset_gives_the_drafter_a_stream_of_its_own():
    """The drafter's generator is seeded with seed + DRAFT_SEED_OFFSET: an offset of 0 would hand it
    the verifier's own random stream, and every allowed seed plus the offset must still be a seed
    torch takes (below 2**64)."""
    import torch

    assert defaults.DRAFT_SEED_OFFSET != 0
    for seed in (0, defaults.MAX_SEED):
        draft = torch.Generator().manual_seed(seed + defaults.DRAFT_SEED_OFFSET)
        target = torch.Generator().manual_seed(seed)
        assert not torch.equal(torch.rand(8, generator=draft), torch.rand(8, generator=target))