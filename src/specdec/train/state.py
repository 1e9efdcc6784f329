"""Saved training state: checkpoints and caches a rerun resumes from.

Every training command resumes after an interruption by reading what it saved beside its output.
Three rules keep that honest:

* a state file is written whole or not at all (a temporary file, then a rename), so a Ctrl-C in
  the middle of a write never leaves a cut-short file behind;
* a file that cannot be read (cut short by a crash elsewhere, or not this command's) is a one-line
  error naming it, not a traceback from deep inside torch or json;
* a state made with other settings is not resumed in silence: :func:`check_resume` names the first
  setting that differs and how to go on.  The step count is the exception: a larger ``--steps``
  continues a run (the commands' help says steps count across resumed runs).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from specdec.errors import ConfigError, Terminated
from specdec.outputs import write_text, write_whole

__all__ = ["BetweenSteps", "check_resume", "load", "load_json", "save", "write_text"]


def _unreadable(path: Path, exc: Exception) -> ConfigError:
    detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return ConfigError(f"{path} cannot be read ({type(exc).__name__}: {detail}); it was cut short or is not this"
                       " command's: delete it to redo that part")


def _present(path: Path) -> bool:
    """Whether a state file is at ``path``; anything else standing there (a folder) is a one-line
    ConfigError now, not a crash when the run first saves there, maybe hours later."""
    if path.is_file():
        return True
    if path.exists():
        raise ConfigError(f"{path} is not a file: move it away, or give another --out")
    return False


def load(path: Path, *, map_location: Any = None) -> Any | None:
    """The torch object saved at ``path``, None where there is no file, or a one-line ConfigError."""
    if not _present(path):
        return None
    try:
        return torch.load(path, weights_only=False, map_location=map_location)
    except Exception as exc:  # noqa: BLE001 - any failure to unpickle is a damaged file here
        raise _unreadable(path, exc) from None


def load_json(path: Path) -> dict | None:
    """The JSON object at ``path``, None where there is no file, or a one-line ConfigError."""
    if not _present(path):
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise _unreadable(path, exc) from None
    if not isinstance(value, dict):
        raise _unreadable(path, ValueError("not a JSON object"))
    return value


def save(obj: Any, path: Path) -> None:
    """``torch.save`` whole or not at all."""
    write_whole(path, lambda tmp: torch.save(obj, tmp))


def check_resume(path: Path, saved: dict, wanted: dict, *, restart: str | None = None) -> None:
    """Refuse to resume the state at ``path`` where a setting in ``wanted`` differs from the one it
    was saved with (``saved``; settings it did not record are not compared).  ``restart``: how to
    start over instead (default: another --out, or deleting the file)."""
    for key in sorted(set(saved) & set(wanted)):
        if _plain(saved[key]) != _plain(wanted[key]):
            raise ConfigError(
                f"{path} was saved by a run with {key} = {_show(saved[key])}, this one asks for {_show(wanted[key])}:"
                " rerun with the same settings to resume it (a larger --steps continues it), or "
                + (restart or f"give another --out (or delete {path.name})") + " to start over"
            )


def _plain(value: Any) -> Any:
    """``value`` as JSON would hold it (tuples as lists), so a setting read back compares equal."""
    return json.loads(json.dumps(value, default=str))


def _show(value: Any) -> str:
    text = json.dumps(_plain(value))
    return text if len(text) <= 80 else text[:77] + "..."


class BetweenSteps:
    """Ctrl-C and SIGTERM held back while a training loop runs, so that a step is never cut in two:
    the first one is noted (:attr:`pending`) and the loop, at the end of the step in progress,
    saves its state and calls :meth:`stop`; a second one stops at once.  Outside the main thread
    (where signals cannot be caught) nothing is held back."""

    def __init__(self) -> None:
        self.pending: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "BetweenSteps":
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
            for s in self._previous:
                signal.signal(s, self._note)
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
        if kind is None and self.pending is not None:  # one that came after the loop's last check is not lost
            self.stop()

    def _note(self, signum: int, frame: Any) -> None:
        if self.pending is not None:
            self.pending = signum
            self.stop()
        self.pending = signum
        print("\n[specdec] stopping after this step, its state saved (again to stop at once)", file=sys.stderr, flush=True)

    def stop_if_pending(self, step: int, path: Path) -> None:
        """Stop if a signal came: called once the loop has saved step ``step`` at ``path``."""
        if self.pending is not None:
            print(f"[specdec] saved at step {step} ({path}): the same command resumes there", file=sys.stderr)
            self.stop()

    def stop(self) -> None:
        """Raise what the signal noted would have raised (SIGTERM: :class:`Terminated`), once."""
        signum, self.pending = self.pending, None
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
