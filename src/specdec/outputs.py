"""Output paths checked before any work: a run that would fail writing its results fails first."""

from __future__ import annotations

import os
from pathlib import Path

from specdec.errors import ConfigError


def check_folder(folder: Path, flag: str = "--out") -> None:
    """``folder`` is a folder (made now if missing) that takes files, or a one-line ConfigError."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{flag} {folder} is a file; give a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".specdec-write-check-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write to {flag} {folder}: {exc.strerror or exc}") from None


def check_file(path: Path, flag: str = "--out") -> None:
    """``path`` can be written as a file: not a folder, its folder made now if missing and writable."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder; give a file")
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise ConfigError(f"cannot write {flag} {path}: {parent} is not a folder")
    check_folder(parent, flag)


__all__ = ["check_file", "check_folder"]
