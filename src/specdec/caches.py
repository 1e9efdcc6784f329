"""Where specdec keeps what it computes once, and ``specdec cache`` (list the parts, clear them).

Everything lives under ``$SPECDEC_CACHE`` (default ``~/.cache/specdec``), in one folder per part;
the calibration and quantised-layer caches can be moved (or turned off) on their own.  Each part
is rebuilt on its next use when cleared, so clearing only costs time.  No torch here: ``specdec
cache`` answers at once.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

#: values of a part's own setting that turn it off
_OFF = ("0", "off", "no", "false", "")


def root() -> Path:
    """The cache's root: ``$SPECDEC_CACHE``, else ``~/.cache/specdec``."""
    return Path(os.environ.get("SPECDEC_CACHE") or Path.home() / ".cache" / "specdec")


def _own(setting: str, default: str) -> Path | None:
    """A part with a setting of its own: that folder, None when the setting turns it off, else ``root()/default``."""
    own = os.environ.get(setting)
    if own is not None and own.strip().lower() in _OFF:
        return None
    return Path(own).expanduser() if own else root() / default


def calibration_dir() -> Path | None:
    """The calibration ranges' folder (``$SPECDEC_CALIBRATION_CACHE``), None when off."""
    return _own("SPECDEC_CALIBRATION_CACHE", "calibration")


def quantised_dir() -> Path | None:
    """The quantised layers' folder (``$SPECDEC_QUANTISED_CACHE``), None when off."""
    return _own("SPECDEC_QUANTISED_CACHE", "quantised")


@dataclass(frozen=True)
class Part:
    """One part of the cache: its name, folder (None: turned off), what it holds, what clearing
    costs, and the file names that are its own (clearing removes those alone)."""

    name: str
    folder: Path | None
    holds: str
    rebuilt: str
    patterns: tuple[str, ...] = ("*",)


def parts() -> list[Part]:
    """Every part, in the order ``specdec cache`` lists them."""
    top = root()
    return [
        Part("models", top / "models", "registry models converted for fast loading (float safetensors)",
             "converted again on next use (~10-60 s a model)"),
        Part("gguf", top / "gguf", "GGUF files assembled from split packages, and GGUFs exported for llama.cpp runs",
             "assembled or exported again on next use"),
        Part("kernels", top / "kernels", "specdec's C++ kernels compiled for this CPU and torch",
             "compiled again on next use (~1-3 min)"),
        Part("calibration", calibration_dir(), "quantised models' input ranges, measured on a calibration text",
             "measured again on next load (~0.3-2 s)", ("*.pt", "*.tmp")),
        Part("quantised", quantised_dir(), "quantised models' int8 and 4-bit layers, packed for the kernels",
             "quantised again on next load (the first start of a 1.5B model: ~15 s longer)", ("*.safetensors", "*.tmp")),
    ]


def _own_files(part: Part) -> list[Path]:
    """The part's own entries in its folder (files, or folders where every name is its own)."""
    if part.folder is None or not part.folder.is_dir():
        return []
    return sorted({p for pattern in part.patterns for p in part.folder.glob(pattern)})


def usage(part: Part) -> tuple[int, int]:
    """(entries, bytes) of a part's own files (a link counts as an entry of no bytes: clearing
    removes the link alone, never what it points at)."""
    entries = _own_files(part)
    size = 0
    for p in entries:
        if p.is_symlink():
            continue
        if p.is_dir():
            size += sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
        elif p.is_file():
            size += p.stat().st_size
    return len(entries), size


def clear(part: Part) -> int:
    """Remove a part's own files; the bytes freed."""
    _, size = usage(part)
    for p in _own_files(part):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
    return size


def human(size: int) -> str:
    """Bytes as people read them (1 decimal, powers of 1024)."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
