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


def test_a_bundle_folder_that_cannot_be_written_fails_first(capsys, tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("mine")
    code, err = _train(capsys, "online", "--out", str(tmp_path / "run"), "--bundle", str(taken))
    assert code == 2 and "--bundle" in err and "is a file; give a folder" in err and taken.read_text() == "mine"
