"""Output paths checked before any work: a run that would fail writing its results fails first.

Nothing is made here: a run refused later for another reason leaves no empty folder behind."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from specdec.errors import ConfigError


def write_whole(path: Path, write: Callable[[Path], None]) -> None:
    """``write`` the file at ``path`` whole or not at all: it writes a temporary file beside it,
    renamed into place once complete, and removed if the write fails or is interrupted (a Ctrl-C
    or SIGTERM mid-write leaves neither a cut-short file nor a stray temporary one)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str) -> None:
    """A UTF-8 text file written whole or not at all (:func:`write_whole`)."""
    write_whole(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def check_folder(folder: Path, flag: str = "--out") -> None:
    """Files can be written in ``folder`` (or in the folders a run would make down to it), or a
    one-line ConfigError."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{flag} {folder} is a file; give a folder")
    base = folder
    while not os.path.lexists(base):  # the nearest folder that is there: the run makes the rest
        base = base.parent
    if base.is_symlink() and not base.exists():  # (the run could not make a folder in its place)
        raise ConfigError(f"cannot write to {flag} {folder}: {base} is a link to {os.readlink(base)}, which does not exist")
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
