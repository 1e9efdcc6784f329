"""Saved training state: files written whole, and signals held back until a step ends."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from specdec.errors import Terminated
from specdec.train.state import BetweenSteps, save, write_text


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
