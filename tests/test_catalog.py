"""What ships besides code (``specdec.catalog``): the draft temperature factor's range, a draft
folder's calibration file, the self-speculative names and shipped files, head folders, and the
rows ``specdec models`` prints for them."""

from __future__ import annotations

import json

import pytest

from specdec import catalog
from specdec.errors import ConfigError


def test_the_temperature_factor_range_is_open_at_zero_and_closed_at_the_maximum():
    assert catalog.check_temperature_factor(100) == 100.0 and catalog.check_temperature_factor(1e-6) == 1e-6
    for bad in (0, -1, 100.5, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=r"must be in \(0, 100\]"):
            catalog.check_temperature_factor(bad)


def test_a_draft_folders_calibration_file_is_read_or_refused_in_one_line(tmp_path):
    assert catalog.calibrated_factor(None) is None and catalog.calibrated_factor(tmp_path) is None
    path = tmp_path / catalog.CALIBRATION_FILE
    path.write_text(json.dumps({"temperature_factor": 0.85}))
    assert catalog.calibrated_factor(tmp_path) == 0.85
    for text, says in (("{}", "KeyError"), ("[1]", "TypeError"), ("{", "JSONDecodeError"),
                       ('{"temperature_factor": 0}', "ConfigError")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=f"not a draft calibration \\({says}") as info:
            catalog.calibrated_factor(tmp_path)
        assert "\n" not in str(info.value)


def test_self_speculative_names_are_read_whatever_their_case():
    assert catalog.parse_self_spec(" SWIFT: skip.json ") == ("swift", "skip.json")
    assert catalog.parse_self_spec("Kangaroo") == ("kangaroo", "")
    assert catalog.parse_self_spec("LayerSkip:8") == ("layerskip", "8")
    assert catalog.parse_self_spec("smollm2-135m-draft") is None


def test_a_shipped_file_is_required_only_where_none_is_given():
    """``self-skip`` and ``kangaroo`` need a shipped file for the target; given their own file, or
    ``swift``, they do not; the shipped targets pass."""
    assert "smollm2-135m" in catalog.skip_set_targets() and catalog.adapter_targets() == ["smollm2-135m"]
    with pytest.raises(ConfigError, match="no searched skip set ships for 'other'"):
        catalog.check_shipped("self-skip", "other")
    with pytest.raises(ConfigError, match="no kangaroo adapter ships for 'other'"):
        catalog.check_shipped("kangaroo", "other")
    for name in ("self-skip:mine.json", "kangaroo:mine.safetensors", "swift", "layerskip:4", "ngram"):
        catalog.check_shipped(name, "other")
    catalog.check_shipped("self-skip", "smollm2-135m")
    catalog.check_shipped("kangaroo", "smollm2-135m")


@pytest.mark.parametrize("config, head", [
    ({"kind": "medusa"}, True),
    ({"speculators_model_type": "eagle3"}, True),
    ({"architectures": ["LlamaForCausalLMEagle3"]}, True),
    ({"kind": "lora"}, False),
    ([], False),
    ("{not json", False),
])
def test_a_head_folder_is_told_by_its_config(tmp_path, config, head):
    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    assert catalog.is_head_folder(tmp_path) is head


def test_the_head_rows_say_which_are_bundled_and_how_to_train_each(tmp_path):
    (tmp_path / "smollm2-135m-medusa").mkdir()
    (tmp_path / "smollm2-135m-medusa" / "config.json").write_text('{"kind": "medusa"}')
    rows = {r["name"]: r for r in catalog.describe_heads(tmp_path)}
    assert {n: r["status"] for n, r in rows.items()} == {
        "smollm2-135m-eagle3": "missing", "smollm2-135m-eagle1": "missing", "smollm2-135m-medusa": "bundled",
        "smollm2-135m-mtp": "missing"}
    assert "specdec train eagle --data data --out HEAD --variant eagle1," in rows["smollm2-135m-eagle1"]["install"]
    assert "specdec train eagle --data data --out HEAD," in rows["smollm2-135m-eagle3"]["install"]
    assert "specdec train medusa --data data --out HEAD," in rows["smollm2-135m-medusa"]["install"]


def test_the_family_rows_name_every_drafter_without_a_model_of_its_own():
    rows = catalog.describe_families()
    assert [r["name"] for r in rows] == ["layerskip:K", "self-skip", "swift", "kangaroo", "ngram", "lookahead", "none"]
    assert "shipped for: qwen2.5-coder-1.5b, smollm2-135m" in rows[1]["description"]


def test_kangaroo_asks_for_an_adapter_not_a_skip_set():
    """A target with a shipped skip set but no shipped adapter: ``kangaroo`` is refused (it needs an
    adapter), ``self-skip`` is not."""
    target = next(t for t in catalog.skip_set_targets() if t not in catalog.adapter_targets())
    catalog.check_shipped("self-skip", target)
    with pytest.raises(ConfigError, match=f"no kangaroo adapter ships for {target!r}"):
        catalog.check_shipped("kangaroo", target)


def test_a_folder_named_like_the_calibration_file_is_no_calibration(tmp_path):
    """Only a file is a calibration: a folder of that name is ignored (None), not a crash."""
    (tmp_path / catalog.CALIBRATION_FILE).mkdir()
    assert catalog.calibrated_factor(tmp_path) is None


def test_a_head_folder_without_a_head_config_is_missing(tmp_path):
    """A folder under the head's registry name is 'bundled' only where it holds a head's config."""
    (tmp_path / "smollm2-135m-medusa").mkdir()
    (tmp_path / "smollm2-135m-mtp").mkdir()
    (tmp_path / "smollm2-135m-mtp" / "config.json").write_text('{"kind": "lora"}')
    rows = {r["name"]: r["status"] for r in catalog.describe_heads(tmp_path)}
    assert rows["smollm2-135m-medusa"] == "missing" and rows["smollm2-135m-mtp"] == "missing"


def test_a_config_with_null_architectures_is_no_head(tmp_path):
    """``"architectures": null`` (as some exported configs write) is simply not a head, not a crash."""
    (tmp_path / "config.json").write_text('{"architectures": null}')
    assert catalog.is_head_folder(tmp_path) is False


def test_the_checked_temperature_factor_is_a_float():
    """The factor comes back as the float it was checked as (an int or a numeric string given,
    e.g. a calibration file's JSON integer), not as the object passed in."""
    for given, want in ((2, 2.0), ("0.5", 0.5)):
        got = catalog.check_temperature_factor(given)
        assert type(got) is float and got == want


def test_a_calibration_file_read_as_a_float(tmp_path):
    """A calibration file writing the factor as a JSON integer gives a float factor."""
    (tmp_path / catalog.CALIBRATION_FILE).write_text(json.dumps({"temperature_factor": 1}))
    got = catalog.calibrated_factor(tmp_path)
    assert type(got) is float and got == 1.0


def test_a_calibration_error_is_one_line_even_where_the_value_holds_a_newline(tmp_path):
    """``"0\\n"`` reads as the float 0 (out of range): the error that echoes the value back is
    still cut to its first line, as every other calibration error is."""
    (tmp_path / catalog.CALIBRATION_FILE).write_text(json.dumps({"temperature_factor": "0\n"}))
    with pytest.raises(ConfigError, match="not a draft calibration \\(ConfigError") as info:
        catalog.calibrated_factor(tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("archs", [[None], [3, "LlamaForCausalLM"]], ids=["null", "a number"])
def test_a_non_string_architecture_is_no_head_not_a_crash(tmp_path, archs):
    """An ``architectures`` list with a non-string entry is read as text: not a head, no error."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": archs}))
    assert catalog.is_head_folder(tmp_path) is False


def test_a_self_speculative_argument_keeps_its_case():
    """Only the family name is case-insensitive: the argument (a file path on a case-sensitive file
    system) is handed on as written, stripped of spaces."""
    assert catalog.parse_self_spec("Self-Skip: Runs/MySkip.json ") == ("self-skip", "Runs/MySkip.json")
