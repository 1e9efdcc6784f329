"""A quantised model's calibration ranges on disk, so that later starts skip the calibration pass.

Quantising a model (``quant="int8"`` or ``"q4"``) first runs a calibration text through it and
records, per linear layer still in float, the per-channel max |input| that sets its smoothing
(:mod:`specdec.models.quantize`).  That pass is ~0.3-0.9 s of every start on two cores.  Its result
is a deterministic function of what this module puts in the key, so it is stored under
``$SPECDEC_CALIBRATION_CACHE`` (default ``$SPECDEC_CACHE/calibration``, i.e.
``~/.cache/specdec/calibration``) and read back by later processes:

* the weight files the model was built from (path, size, modification time: a changed file is a
  new key), the calibration ids, the model's config and constructor options;
* the code that computes the pass: every Python source of ``specdec``, the compiled
  library's name (a hash of its C++ sources, torch, compiler, CPU and flags) or none, whether
  exact attention runs on it, every ``SPECDEC_*`` setting, torch's version and thread count.

A stored entry must name exactly the model's range recorders with the shapes they have, or it is
not used.  Anything unreadable is a miss (the pass runs, the entry is rewritten); writes go through
a temporary file and a rename, so concurrent starts never read half a file.
``SPECDEC_CALIBRATION_CACHE=off`` turns the cache off.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

#: entries kept (an entry is a few KB to ~100 KB; the oldest written go first)
KEEP = 64
#: settings that never change a pass's numbers (where files go, credentials, which pages the
#: weights sit on: models.hugepages moves them after they are built, the same bits)
_NEUTRAL_ENV = ("SPECDEC_CACHE", "SPECDEC_CALIBRATION_CACHE", "SPECDEC_QUANTISED_CACHE", "SPECDEC_API_KEY",
                "SPECDEC_HUGE_PAGES")


def cache_dir() -> Path | None:
    """Where entries live, or None when the cache is off."""
    from specdec import caches

    return caches.calibration_dir()


def file_identity(paths: list[Path]) -> list[list[Any]]:
    """(resolved path, size, modification time in ns) of each file, in the order given."""
    out = []
    for p in paths:
        st = Path(p).stat()
        out.append([str(Path(p).resolve()), st.st_size, st.st_mtime_ns])
    return out


@functools.lru_cache(maxsize=1)
def _code_digest() -> str:
    """Every Python source of the ``specdec`` package, hashed once per process: the pass's own code
    lives in ``specdec.models``, but what it calls (the KV cache, the tree schedule) does not, and
    hashing it all (~10 ms) is cheaper than keeping a list of what matters."""
    package = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def key(parts: dict[str, Any]) -> str | None:
    """The entry's name: ``parts`` (what the caller knows of the model) and this process's code,
    kernels and settings, hashed (:func:`digest`); None when the cache is off (nothing to read or write)."""
    if cache_dir() is None:
        return None
    return digest(parts)


def digest(parts: dict[str, Any]) -> str:
    """``parts`` and this process's code, kernels and settings, hashed: what a pass over a model
    made from those parts can depend on (also the name of :mod:`specdec.models.quantised_cache`'s entries)."""
    from specdec.models import kernels

    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("SPECDEC_") and k not in _NEUTRAL_ENV)
    full = {
        **parts,
        "code": _code_digest(),
        "library": kernels.library() if kernels.load() else None,  # loaded now: the pass would load it
        "attention_kernel": kernels.attention_kernel(),
        "env": env,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    return hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:32]


def tensor_digest(t: Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()


def load(name: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, Tensor] | None:
    """The stored ranges of entry ``name`` when they are exactly ``shapes`` (recorder name ->
    shape of its range), else None."""
    folder = cache_dir()
    if folder is None:
        return None
    try:
        ranges = torch.load(folder / f"{name}.pt", weights_only=True)
    except Exception:  # noqa: BLE001 - missing, truncated, or not ours: compute it again
        return None
    if not isinstance(ranges, dict) or set(ranges) != set(shapes):
        return None
    if any(not isinstance(t, Tensor) or tuple(t.shape) != shapes[k] or t.dtype != torch.float32 for k, t in ranges.items()):
        return None
    return ranges


def save(name: str, ranges: dict[str, Tensor]) -> None:
    """Store ``ranges`` as entry ``name`` (best effort: a read-only disk only costs the next start),
    keeping the :data:`KEEP` most recently written entries (every code change makes new keys)."""
    folder = cache_dir()
    if folder is None:
        return
    tmp = folder / f"{name}.{os.getpid()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save({k: t.detach().clone() for k, t in ranges.items()}, tmp)
        tmp.replace(folder / f"{name}.pt")
        entries = sorted(folder.glob("*.pt"), key=lambda p: p.stat().st_mtime_ns)
        for old in entries[: max(0, len(entries) - KEEP)]:
            old.unlink(missing_ok=True)
    except OSError:
        tmp.unlink(missing_ok=True)
