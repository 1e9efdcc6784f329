"""``specdec train …``: where the results go is checked before anything loads or trains."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from specdec.cli import main
from specdec.errors import ConfigError
from specdec.outputs import check_file, check_folder, write_whole

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


class Loaded(Exception):
    """The command got past its checks: it loads a model."""


def _no_load(monkeypatch):
    def load(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr("specdec.models.registry.load", load)


@pytest.mark.parametrize("command, argv, says", [
    ("data", ["--sequences", "0"], "--sequences and --batch must be >= 1"),
    ("data", ["--batch", "0"], "--sequences and --batch must be >= 1"),
    ("data", ["--chat-share", "1.5"], "--chat-share in [0, 1]"),
    ("data", ["--chat-share", "-0.1"], "--chat-share in [0, 1]"),
    ("data", ["--taps", "2,-1"], "--taps must be a non-empty comma list of non-negative integers"),
    ("data", ["--temperatures", "0,-1"], "--temperatures needs at least one value >= 0"),
    ("data", ["--temperatures", "x"], "--temperatures must be a comma list of numbers"),
    ("eagle", ["--batch-tokens", "15"], "--batch-tokens >= 16"),
    ("medusa", ["--draft-vocab", "1"], "--draft-vocab >= 2"),
    ("online", ["--add-layers", "0,0"], "--add-layers needs distinct values"),
    ("online", ["--add-layers", "0,-2"], "--add-layers must be a non-empty comma list of non-negative integers"),
    ("online", ["--sequences", "0", "--gen-seconds", "0"], "give --sequences or a positive --gen-seconds"),
    ("skip", ["--polish", "-1"], "--polish must be >= 0, got -1"),
    ("skip", ["--prompts", "0"], "--prompts and --new-tokens must be >= 1"),
    ("calibrate", ["--temperatures", "0"], "--temperatures must be positive numbers"),
    ("calibrate", ["--new-tokens", "0"], "--new-tokens >= 1"),
    ("calibrate", ["--draft", "smollm2-135m-draft+lookup"], "calibrate measures a draft model"),
    ("skip", ["--new-tokens", "0"], "--prompts and --new-tokens must be >= 1"),
    ("online", ["--fed", "-1"], "--fed must be >= 0"),
    ("online", ["--fed", "1", "--fed-lr", "0.1,0.1"], "--fed-lr distinct positive values"),
    ("online", ["--fed", "1", "--fed-lr", "0"], "--fed-lr distinct positive values"),
    ("online", ["--code-repeats", "-1"], "counts must be >= 0"),
    ("online", ["--gen-batch", "0"], "--gen-batch, --batch-tokens and --lr positive"),
    ("eagle", ["--steps", "0"], "--steps, --depth, --eval-every >= 1"),
    ("medusa", ["--depth", "0"], "--steps, --depth, --eval-every >= 1"),
    ("kangaroo", ["--positions", "0"], "--positions"),
    ("distill", ["--top-k", "0"], "--top-k"),
    ("data", ["--taps", ","], "--taps must be a non-empty comma list"),
])
def test_out_of_range_settings_fail_before_anything_loads(capsys, tmp_path, monkeypatch, command, argv, says):
    _no_load(monkeypatch)
    out = tmp_path / {"skip": "run.json", "kangaroo": "run.safetensors"}.get(command, "run")
    code, err = _train(capsys, command, "--out", str(out), *argv)
    lines = [line for line in err.strip().splitlines() if not line.startswith("[specdec]")]
    assert code == 2 and len(lines) == 1 and says in lines[0] and "Traceback" not in err, err


def test_online_takes_every_built_in_chat_instruction_and_not_one_more(capsys, tmp_path, monkeypatch):
    """--chat-prompts may ask for all the built-in instructions; one more is refused in one line."""
    from specdec.train.prompts import chat_prompts

    available = len(chat_prompts(10**7))
    _no_load(monkeypatch)
    with pytest.raises(Loaded):
        _train(capsys, "online", "--out", str(tmp_path / "all"), "--chat-prompts", str(available))
    code, err = _train(capsys, "online", "--out", str(tmp_path / "more"), "--chat-prompts", str(available + 1))
    assert code == 2 and f"there are {available:,} built-in chat instructions" in err, err


@pytest.mark.parametrize("argv", [["--chat-share", "0"], ["--chat-share", "1"], ["--temperatures", "0"], ["--taps", "0"],
                                  ["--sequences", "1", "--batch", "1"]])
def test_data_settings_at_the_edge_of_their_range_are_accepted(capsys, tmp_path, monkeypatch, argv):
    _no_load(monkeypatch)
    with pytest.raises(Loaded):
        _train(capsys, "data", "--out", str(tmp_path / "run"), *argv)


def test_data_taps_up_to_the_targets_last_layer(capsys, tmp_path):
    """A tap may name the last layer (layer count n); n + 1 is refused in one line."""
    from tiny import make_tiny

    target = make_tiny(tmp_path / "target", seed=0, layers=2, hidden=32, max_positions=128)
    base = ["train", "data", "--target", str(target), "--sequences", "2", "--batch", "2", "--max-new-chat", "2",
            "--max-new-code", "2"]
    assert main([*base, "--out", str(tmp_path / "ok"), "--taps", "0,2"]) == 0
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "no"), "--taps", "3"]) == 2
    assert "--taps must be <= the target's 2 layers" in capsys.readouterr().err


def test_checking_a_folder_leaves_no_probe_file_behind(tmp_path):
    """The write check's probe file is removed: the folder (and the one a run would make under it)
    is as it was."""
    (tmp_path / "kept.txt").write_text("x")
    check_folder(tmp_path)
    check_folder(tmp_path / "new" / "sub")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt"]


def test_a_path_under_a_file_names_the_file_in_the_way(tmp_path):
    """``--out taken/x/y`` where ``taken`` is a file: the one line says which part is not a folder."""
    taken = tmp_path / "taken"
    taken.write_text("mine")
    with pytest.raises(ConfigError, match=f"cannot write to --out .*: {taken} is not a folder"):
        check_folder(taken / "x" / "y")
    assert taken.read_text() == "mine"


def test_check_file_passes_its_flag_on_to_the_folder_check(tmp_path):
    """A file path whose folders cannot be made is reported under the flag the caller named."""
    taken = tmp_path / "taken"
    taken.write_text("mine")
    with pytest.raises(ConfigError, match="--bundle"):
        check_file(taken / "x" / "state.json", "--bundle")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_any_os_error_of_the_write_check_is_a_config_error():
    """Not only a permission error: /proc takes no new files (ENOENT), still a one-line ConfigError."""
    with pytest.raises(ConfigError, match="cannot write to --out /proc"):
        check_folder(Path("/proc"))


def _head_data(tmp_path):  # -> (a tiny target's folder, a training-data folder that passes the command's checks)
    from tiny import make_tiny

    folder = make_tiny(tmp_path / "m", seed=3, max_positions=64)
    data = tmp_path / "data"
    data.mkdir()
    (data / "config.json").write_text(json.dumps({"taps": [1], "features": True}))
    (data / "shard-00000.pt").write_bytes(b"")
    return folder, data


def test_kangaroo_refuses_a_top_k_below_one_before_anything_loads(capsys, tmp_path, monkeypatch):
    """--top-k 0 would keep no target probability to distil: one line, exit 2, no model loaded."""
    _no_load(monkeypatch)
    code = main(["train", "kangaroo", "--out", str(tmp_path / "a.safetensors"), "--top-k", "0"])
    err = capsys.readouterr().err
    assert code == 2 and "--top-k" in err and "must be positive" in err and "Traceback" not in err


def test_calibrate_accepts_all_144_built_in_prompts(capsys, tmp_path, monkeypatch):
    """--prompts is "at most 144": 144 itself gets past the checks (to the model load)."""
    from tiny import make_tiny

    folder = make_tiny(tmp_path / "m", seed=3, max_positions=64)
    _no_load(monkeypatch)
    with pytest.raises(Loaded):
        main(["train", "calibrate", "--target", str(folder), "--draft", str(folder), "--out", str(tmp_path / "o"),
              "--prompts", "144"])
    assert main(["train", "calibrate", "--target", str(folder), "--draft", str(folder), "--out", str(tmp_path / "o"),
                 "--prompts", "145"]) == 2
    assert "--prompts must be 1-144" in capsys.readouterr().err


def test_head_training_gets_every_option_it_was_given(tmp_path, monkeypatch):
    """`specdec train medusa` passes --eval-every (and the other settings) on to the trainer."""
    from specdec.train import heads as th

    folder, data = _head_data(tmp_path)
    got = {}

    def fake_train(cfg, data_dir, out, target, **kw):
        got["cfg"], got["kw"] = cfg, kw
        return {"held_out": {"steps": []}, "finished": True, "steps": cfg.steps, "train_seconds": 0.0}

    monkeypatch.setattr(th, "train", fake_train)
    code = main(["train", "medusa", "--data", str(data), "--out", str(tmp_path / "out"), "--target", str(folder),
                 "--steps", "7", "--batch-tokens", "64", "--lr", "0.01", "--draft-vocab", "5", "--depth", "2",
                 "--eval-every", "3", "--max-minutes", "1.5"])
    assert code == 0
    cfg = got["cfg"]
    assert (cfg.kind, cfg.steps, cfg.batch_tokens, cfg.lr, cfg.draft_vocab, cfg.depth, cfg.eval_every) == \
        ("medusa", 7, 64, 0.01, 5, 2, 3)
    assert got["kw"]["max_minutes"] == 1.5


@pytest.mark.parametrize("value", ["0", "-5"])
def test_head_training_refuses_an_eval_every_below_one_before_training(capsys, tmp_path, monkeypatch, value):
    """--eval-every 0 used to train a step and then die with ZeroDivisionError (step % 0) in the
    training loop; a negative one evaluated at odd steps. It is a one-line error, exit 2, first,
    and a library caller's TrainConfig refuses it too."""
    from specdec.train import heads as th

    folder, data = _head_data(tmp_path)
    monkeypatch.setattr(th, "train", lambda *a, **k: pytest.fail("training started"))
    code = main(["train", "medusa", "--data", str(data), "--out", str(tmp_path / "out"), "--target", str(folder),
                 "--eval-every", value])
    err = capsys.readouterr().err
    assert code == 2 and "--eval-every" in err and "Traceback" not in err, err
    with pytest.raises(ConfigError, match="eval_every"):
        th.TrainConfig(kind="medusa", eval_every=int(value))
    with pytest.raises(ConfigError, match="ckpt_every"):
        th.TrainConfig(kind="medusa", ckpt_every=int(value))


def test_a_failed_write_of_a_file_named_tmp_keeps_the_old_file(tmp_path):
    """The temporary file is the name + ".tmp", never the file itself: a failed write of
    ``notes.tmp`` leaves the old ``notes.tmp`` as it was (a temporary ``path.with_suffix(".tmp")``
    would be the file itself, and removing it on failure would delete the user's file)."""
    path = tmp_path / "notes.tmp"
    path.write_text("old")

    def fails(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_whole(path, fails)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.tmp"]
    write_whole(path, lambda tmp: tmp.write_text("new"))
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["notes.tmp"]


@pytest.mark.skipif(not sys.platform.startswith("linux") or not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_the_write_check_error_says_why_without_its_probe_file():
    """The one line gives the OS's reason (its strerror), not the internal probe file's name the
    check tried to write (``.specdec-write-check-PID``), which the user never asked for."""
    with pytest.raises(ConfigError) as caught:
        check_folder(Path("/proc"))
    message = str(caught.value)
    assert message.startswith("cannot write to --out /proc: ") and ".specdec-write-check" not in message


@pytest.mark.parametrize("under", [False, True])
def test_an_out_through_a_link_to_nothing_fails_first(tmp_path, under):
    """``--out LINK`` (or ``LINK/sub``) where LINK is a symbolic link to nothing: the check used to
    pass (``exists()`` is False for it, so it walked up past it), and the run's
    ``mkdir(parents=True, exist_ok=True)`` then failed with FileExistsError after all the work."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    out = link / "sub" if under else link
    with pytest.raises(ConfigError, match=f"cannot write to --out {out}: {link} is a link to .*gone, which does not exist"):
        check_folder(out)
    with pytest.raises(FileExistsError):  # what the run would have met
        out.mkdir(parents=True, exist_ok=True)


def test_a_write_interrupted_by_ctrl_c_leaves_neither_the_file_nor_its_temporary(tmp_path):
    """KeyboardInterrupt is not an Exception: the temporary file is removed for it too (and the
    interrupt goes on), so a Ctrl-C mid-write leaves no stray ``.tmp`` beside an absent result."""
    path = tmp_path / "out.json"

    def interrupted(tmp):
        tmp.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_whole(path, interrupted)
    assert list(tmp_path.iterdir()) == []
