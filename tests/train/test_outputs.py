"""``specdec train …``: where the results go is checked before anything loads or trains."""

from __future__ import annotations

import pytest

from specdec.cli import main

FOLDER_OUT = ["data", "distill", "eagle", "medusa", "mtp", "online", "calibrate"]
FILE_OUT = ["kangaroo", "skip"]


def _train(capsys, command, *argv):
    extra = ["--data", "no-such-data"] if command in ("distill", "eagle", "medusa", "mtp") else []
    code = main(["train", command, *extra, *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command", FOLDER_OUT + FILE_OUT)
def test_an_out_that_cannot_be_written_fails_first(capsys, tmp_path, monkeypatch, command):
    """Each used to fail with a traceback at the end: after the models loaded, the data was made or
    the training ran (``--out`` naming a file, a path under a file, a folder where a file goes)."""
    monkeypatch.setattr("specdec.models.registry.load", lambda *a, **k: pytest.fail("a model was loaded"))
    taken = tmp_path / "taken"
    taken.write_text("mine")
    cases = [(taken / "x", "is not a folder" if command in FILE_OUT else "cannot write to --out")]
    cases.append((tmp_path, "is a folder; give a file") if command in FILE_OUT else (taken, "is a file; give a folder"))
    for out, says in cases:
        code, err = _train(capsys, command, "--out", str(out))
        lines = [line for line in err.strip().splitlines() if not line.startswith("[specdec]")]
        assert code == 2 and len(lines) == 1 and says in lines[0] and "Traceback" not in err, (out, err)
    assert taken.read_text() == "mine"


@pytest.mark.parametrize("command", FILE_OUT)
def test_a_file_out_under_missing_folders_gets_them_before_anything_loads(capsys, tmp_path, monkeypatch, command):
    """skip and kangaroo write their resumable state beside --out as they go; under folders that
    were not there, that write used to fail with a traceback after the target had run for minutes."""

    class Loaded(Exception):
        pass

    def load(*args, **kwargs):
        assert (tmp_path / "new" / "sub").is_dir(), "the model loaded before --out's folder was made"
        raise Loaded

    monkeypatch.setattr("specdec.models.registry.load", load)
    with pytest.raises(Loaded):
        _train(capsys, command, "--out", str(tmp_path / "new" / "sub" / "result.json"))


def test_a_bundle_folder_that_cannot_be_written_fails_first(capsys, tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("mine")
    code, err = _train(capsys, "online", "--out", str(tmp_path / "run"), "--bundle", str(taken))
    assert code == 2 and "--bundle" in err and "is a file; give a folder" in err and taken.read_text() == "mine"


@pytest.mark.parametrize("command", ["distill", "eagle"])
@pytest.mark.parametrize("damage", ["config", "shard"])
def test_damaged_training_data_is_a_one_line_error(capsys, tmp_path, command, damage):
    """A data folder whose config.json is not JSON, or whose shard is not a shard: one line, exit 2."""
    import json

    from tiny import make_tiny

    data = tmp_path / "data"
    data.mkdir()
    (data / "config.json").write_text("{bad" if damage == "config" else json.dumps({"features": True}))
    (data / "shard-00000.pt").write_bytes(b"not a torch file" if damage == "shard" else b"")
    target = make_tiny(tmp_path / "target", seed=0, max_positions=64)
    model = ["--target", str(target)] if command == "eagle" else ["--draft", str(target)]
    code = main(["train", command, "--data", str(data), *model, "--out", str(tmp_path / "out"), "--steps", "1"])
    err = capsys.readouterr().err
    says = "config.json is not valid JSON" if damage == "config" else "is not a shard written by `specdec train data`"
    errors = [piece for piece in err.replace("\r", "\n").splitlines() if "specdec: error:" in piece]
    assert code == 2 and len(errors) == 1 and says in errors[0] and "Traceback" not in err, err


@pytest.mark.parametrize("command, argv, says", [
    ("data", ["--max-new-code", "-1"], "--max-new-chat and --max-new-code must be >= 1"),
    ("data", ["--max-new-chat", "0"], "--max-new-chat and --max-new-code must be >= 1"),
    ("online", ["--max-new-chat", "0"], "--max-new-chat and --max-new-code must be >= 1"),
    ("online", ["--chat-prompts", "999999"], "built-in chat instructions"),  # was capped in silence
])
def test_out_of_range_counts_fail_before_anything_loads(capsys, tmp_path, monkeypatch, command, argv, says):
    monkeypatch.setattr("specdec.models.registry.load", lambda *a, **k: pytest.fail("a model was loaded"))
    code, err = _train(capsys, command, "--out", str(tmp_path / "run"), *argv)
    assert code == 2 and says in err and "Traceback" not in err and not (tmp_path / "run").exists(), err
