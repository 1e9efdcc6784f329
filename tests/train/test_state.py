"""Saved training state: files written whole, and signals held back until a step ends."""

from __future__ import annotations

import os
import pickle
import signal
import threading
from pathlib import Path

import pytest
import torch

from specdec.errors import ConfigError, Terminated
from specdec.train import state
from specdec.train.state import BetweenSteps, check_resume, load, load_json, save, write_text


def test_a_file_is_written_whole_or_not_at_all(tmp_path: Path) -> None:
    """An interrupted or failed write leaves the file as it was and no temporary file beside it."""
    path = tmp_path / "state.json"
    write_text(path, "old")

    class Interrupting:
        def __reduce__(self):  # torch.save pickles this: interrupted mid-write
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save({"a": Interrupting()}, path)
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    write_text(path, "new")
    assert path.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_a_signal_waits_for_the_step_and_a_second_one_does_not(capsys) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with BetweenSteps() as held:
        os.kill(os.getpid(), signal.SIGINT)  # noted, nothing raised: the step goes on
        assert held.pending == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # again: at once
    assert "stopping after this step" in capsys.readouterr().err
    with BetweenSteps() as held:
        held.stop_if_pending(3, Path("ckpt.pt"))  # nothing came: goes on
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(Terminated):
            held.stop_if_pending(4, Path("ckpt.pt"))
    assert "saved at step 4 (ckpt.pt)" in capsys.readouterr().err
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_signal_after_the_loops_last_check_is_not_lost() -> None:
    with pytest.raises(KeyboardInterrupt):
        with BetweenSteps():
            os.kill(os.getpid(), signal.SIGINT)  # noted; the block ends without asking


def test_a_state_file_that_is_json_but_not_an_object_is_a_one_line_error(tmp_path: Path) -> None:
    """A JSON list or number where a state object goes is not this command's file: a ConfigError
    naming it (it used to reach the caller, whose ``state.get`` then failed with a traceback)."""
    path = tmp_path / "run.json"
    assert load_json(path) is None  # no file: nothing to resume
    write_text(path, '{"a": 1}')
    assert load_json(path) == {"a": 1}
    for text in ("[1, 2]", "3", '"x"', "null"):
        write_text(path, text)
        with pytest.raises(ConfigError) as exc:
            load_json(path)
        assert str(path) in str(exc.value) and "not a JSON object" in str(exc.value)


def test_a_folder_where_a_state_file_goes_is_a_one_line_error(tmp_path: Path) -> None:
    """A folder standing at a state file's path is refused on reading, naming it: read as "no
    state" it let a run start over and fail only at its first save, with a traceback."""
    for reader in (load, load_json):
        path = tmp_path / f"{reader.__name__}.state"
        assert reader(path) is None
        path.mkdir()
        with pytest.raises(ConfigError) as exc:
            reader(path)
        assert str(path) in str(exc.value) and "not a file" in str(exc.value)


def test_check_resume_compares_settings_as_json_holds_them(tmp_path: Path) -> None:
    """A setting read back from JSON (a list) equals the tuple this run asks for; settings only one
    side recorded are not compared; a real difference names the setting, both values, and the
    caller's way to start over."""
    path = tmp_path / "run.json"
    check_resume(path, {"temperatures": [0.0, 1.0], "add_layers": [0], "old": 1},
                 {"temperatures": (0.0, 1.0), "add_layers": (0,), "new": 2})
    with pytest.raises(ConfigError) as exc:
        check_resume(path, {"temperatures": [0.0, 1.0]}, {"temperatures": (0.0, 0.7)}, restart="empty the folder")
    text = str(exc.value)
    assert "temperatures = [0.0, 1.0], this one asks for [0.0, 0.7]" in text and "empty the folder to start over" in text
    with pytest.raises(ConfigError) as exc:
        check_resume(path, {"lr": 0.1}, {"lr": 0.2})
    assert "give another --out (or delete run.json) to start over" in str(exc.value)


def test_check_resume_compares_the_runs_key_too(tmp_path: Path) -> None:
    """The commands put the data's identity under ``key``: a checkpoint of other data is refused."""
    path = tmp_path / "ckpt.pt"
    check_resume(path, {"key": {"target": "a", "layers": 2}}, {"key": {"target": "a", "layers": 2}})
    with pytest.raises(ConfigError, match="was saved by a run with key = "):
        check_resume(path, {"key": {"target": "a", "layers": 2}}, {"key": {"target": "a", "layers": 3}})


def test_load_reads_back_the_objects_a_command_saves(tmp_path: Path) -> None:
    """Checkpoints and label caches hold more than tensors (distill's Labels, a generator state):
    load gives them back as saved, not a weights-only refusal."""
    from specdec.train.distill import Labels

    x = Labels(torch.arange(5), 1, torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.long), "chat")
    path = tmp_path / "labels.pt"
    save({"labels": [x], "gen": torch.Generator().manual_seed(3).get_state(), "note": Path("a")}, path)
    back = load(path)
    assert isinstance(back["labels"][0], Labels) and back["labels"][0].kind == "chat"
    assert torch.equal(back["labels"][0].top_p, x.top_p) and back["note"] == Path("a")


def test_a_cut_short_torch_file_is_a_one_line_error(tmp_path: Path) -> None:
    """A checkpoint cut short by a crash fails inside torch (not with an OSError): still a ConfigError naming it."""
    path = tmp_path / "ckpt.pt"
    save({"step": 3, "w": torch.zeros(100)}, path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ConfigError) as exc:
        load(path)
    assert str(path) in str(exc.value) and "delete it to redo that part" in str(exc.value)


@pytest.mark.parametrize("content", [b'{"step": ', b"\xff\xfe not text"])
def test_a_damaged_json_state_is_a_one_line_error(tmp_path: Path, content: bytes) -> None:
    """Cut-short JSON (JSONDecodeError) or bytes that are not UTF-8 (UnicodeDecodeError): a ConfigError naming the file."""
    path = tmp_path / "run.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as exc:
        load_json(path)
    assert str(path) in str(exc.value) and "cannot be read" in str(exc.value)


def test_an_error_in_the_step_is_not_replaced_by_a_pending_signal() -> None:
    """A step that fails while a Ctrl-C waits raises its own error: the held-back signal must not
    mask it with a KeyboardInterrupt on the way out."""
    caught: BaseException | None = None
    try:
        with BetweenSteps():
            os.kill(os.getpid(), signal.SIGINT)  # noted
            raise ValueError("the step failed")
    except BaseException as exc:  # noqa: BLE001 - which one arrives is the point
        caught = exc
    assert isinstance(caught, ValueError), repr(caught)


def test_check_resume_compares_a_path_setting_as_its_text(tmp_path: Path) -> None:
    """A setting that JSON cannot hold as such (a Path) is compared as the text a saved run kept:
    equal text resumes, other text is the usual one-line refusal (not a TypeError from json)."""
    path = tmp_path / "ckpt.pt"
    check_resume(path, {"source": "drafts/a"}, {"source": Path("drafts/a")})
    with pytest.raises(ConfigError, match='source = "drafts/a", this one asks for "drafts/b"'):
        check_resume(path, {"source": "drafts/a"}, {"source": Path("drafts/b")})


def test_outside_the_main_thread_nothing_is_held_back() -> None:
    """BetweenSteps in a worker thread (where signals cannot be caught) is a no-op, not a ValueError
    from signal.signal; the main thread's handlers stay as they were."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    errors: list[BaseException] = []

    def work() -> None:
        try:
            with BetweenSteps() as held:
                held.stop_if_pending(1, Path("ckpt.pt"))
        except BaseException as exc:  # noqa: BLE001 - any error is the failure
            errors.append(exc)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert errors == [] and {s: signal.getsignal(s) for s in before} == before


def test_load_passes_map_location_on(tmp_path: Path) -> None:
    """``map_location`` reaches torch.load: tensors come back where the caller asked (here: meta)."""
    path = tmp_path / "ckpt.pt"
    save({"w": torch.zeros(3)}, path)
    assert load(path, map_location="meta")["w"].device.type == "meta"
    assert load(path)["w"].device.type == "cpu"


def test_an_unreadable_file_with_a_message_less_error_is_still_one_line(tmp_path: Path, monkeypatch) -> None:
    """An unpickling error that carries no message (``UnpicklingError()``) still gives the one-line
    ConfigError, naming the error type (not an IndexError from an empty message)."""
    path = tmp_path / "ckpt.pt"
    save({"step": 1}, path)

    def fail(*args, **kwargs):
        raise pickle.UnpicklingError()

    monkeypatch.setattr(state.torch, "load", fail)
    with pytest.raises(ConfigError, match=r"cannot be read \(UnpicklingError: UnpicklingError\)"):
        load(path)


def test_a_long_setting_is_shown_cut_to_80_characters_and_one_of_80_whole(tmp_path: Path) -> None:
    """check_resume shows a value up to 80 characters (as JSON) whole; a longer one as its first 77
    characters and "..." (80 in all), so the refusal stays one readable line."""
    path = tmp_path / "run.json"
    exactly = "a" * 78  # as JSON: 78 + 2 quotes = 80 characters
    with pytest.raises(ConfigError) as exc:
        check_resume(path, {"x": exactly}, {"x": "b"})
    assert f'x = "{exactly}", this one asks for "b"' in str(exc.value)
    longer = "c" * 100
    with pytest.raises(ConfigError) as exc:
        check_resume(path, {"x": longer}, {"x": "b"})
    shown = '"' + "c" * 76 + "..."
    assert len(shown) == 80 and f"x = {shown}, this one asks for" in str(exc.value)


def test_an_unreadable_files_error_keeps_the_first_line_of_the_cause_up_to_200_characters(
        tmp_path: Path, monkeypatch) -> None:
    """The ConfigError names the cause's type and the first line of its message, cut to 200
    characters: one line, whatever torch or pickle said."""
    path = tmp_path / "ckpt.pt"
    save({"step": 1}, path)

    def fail_with(message: str):
        def fail(*args, **kwargs):
            raise RuntimeError(message)
        return fail

    monkeypatch.setattr(state.torch, "load", fail_with("first line\nsecond line"))
    with pytest.raises(ConfigError) as exc:
        load(path)
    assert "(RuntimeError: first line)" in str(exc.value) and "second line" not in str(exc.value)
    monkeypatch.setattr(state.torch, "load", fail_with("x" * 300))
    with pytest.raises(ConfigError) as exc:
        load(path)
    assert "(RuntimeError: " + "x" * 200 + ")" in str(exc.value)


def test_a_second_signal_that_is_a_sigterm_raises_terminated() -> None:
    """Ctrl-C noted, then SIGTERM: the second one stops at once, as what it is (Terminated, not
    the first one's KeyboardInterrupt)."""
    caught: BaseException | None = None
    try:
        with BetweenSteps() as held:
            os.kill(os.getpid(), signal.SIGINT)
            assert held.pending == signal.SIGINT
            os.kill(os.getpid(), signal.SIGTERM)
    except BaseException as exc:  # noqa: BLE001 - which one arrives is the point
        caught = exc
    assert isinstance(caught, Terminated), repr(caught)


def test_a_sigterm_after_the_loops_last_check_is_terminated_on_the_way_out() -> None:
    """A SIGTERM noted after the last stop_if_pending is raised at the block's end as Terminated."""
    caught: BaseException | None = None
    try:
        with BetweenSteps():
            os.kill(os.getpid(), signal.SIGTERM)
    except BaseException as exc:  # noqa: BLE001 - which one arrives is the point
        caught = exc
    assert isinstance(caught, Terminated), repr(caught)
