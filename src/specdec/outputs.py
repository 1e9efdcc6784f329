"""Output paths checked before any work: a run that would fail writing its results fails first.

Nothing is made here: a run refused later for another reason leaves no empty folder behind."""

from __future__ import annotations

import os
from pathlib import Path

from specdec.errors import ConfigError


def check_folder(folder: Path, flag: str = "--out") -> None:
    """Files can be written in ``folder`` (or in the folders a run would make down to it), or a
    one-line ConfigError."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{flag} {folder} is a file; give a folder")
    base = folder
    while not base.exists():  # the nearest folder that is there: the run makes the rest
        base = base.parent
    if not base.is_dir():
        raise ConfigError(f"cannot write to {flag} {folder}: {base} is not a folder")
    probe = base / f".specdec-write-check-{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write to {flag} {folder}: {exc.strerror or exc}") from None


def check_file(path: Path, flag: str = "--out") -> None:
    """``path`` can be written as a file: not a folder, in a folder that takes files."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file")
    if path.parent.exists() and not path.parent.is_dir():
        raise ConfigError(f"cannot write {flag} {path}: {path.parent} is not a folder")
    check_folder(path.parent, flag)


__all__ = ["check_file", "check_folder"]
