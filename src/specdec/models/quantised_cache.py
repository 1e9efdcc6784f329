"""A quantised model's layers on disk, so that later starts read them instead of making them.

Building an int8 model (``quant="int8"``: a target with ``--dtype int8``, a draft with
``--draft-dtype w8a8``) reads every float32 weight, runs the calibration text through the float
layers, smooths and quantises each matrix and packs it for the few-row int8 kernel; a 4-bit one
(``quant="q4"``) quantises its layer matrices to 4-bit blocks (or reads a GGUF's) and packs them,
and its LM head as the int8 model's.  For
Qwen2.5-Coder-1.5B that is ~11 s of a ~21 s start on two cores and a 12.5 GB peak: the float32
weights are read whole first.  The result is a deterministic function of the same things the
calibration's ranges depend on (:func:`specdec.models.calibration_cache.digest`: the weight files'
path, size and modification time, what the calibration ids are computed from, the config and
options, specdec's code, its compiled kernels' build, every ``SPECDEC_*`` setting, torch and the
thread count), so it is stored under that key in ``$SPECDEC_QUANTISED_CACHE`` (default ``$SPECDEC_CACHE/quantised``) as
one safetensors file: per int8 layer the kernel's packing, the float64 weight scales, and the bias
and smoothing where there are any (:meth:`specdec.models.linear.W8A8Linear.state`), per 4-bit layer
the 4-bit kernel's packing, its input gain, output factors and bias (:meth:`~specdec.models.linear.Q4Linear.state`).
A later start reads that and the float embedding alone (``safe_open``'s tensors are views of the
mapped files, not copies), and rebuilds bitwise the same model.

Only models whose every layer has its kernel's packing are stored (an int8 layer held in fbgemm's
packed form alone cannot be saved; oneDNN-packed ``--int8-kernel onednn`` models are not either).
An entry that does not name exactly the layers and fields the model expects, with their dtypes
and sizes, is not used; anything unreadable is a miss (the model is built and the entry
rewritten); writes go through a temporary file and a rename.  Entries are large (the int8 weights:
~1.5 GB for a 1.5B model), so only the :data:`KEEP` most recently used are kept (a read marks its
entry used) and none is written where the disk would be left with less than :data:`FREE_MARGIN` bytes.  ``SPECDEC_QUANTISED_CACHE=off`` turns it off.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from torch import Tensor

#: entries kept (the most recently used): the registry's two pairs and Gemma 3 with room to spare, so
#: switching between models does not rebuild one (a pair is two entries)
KEEP = 6
#: free bytes a write must leave on the disk
FREE_MARGIN = 2 << 30
#: the file's format, in its metadata: an entry of another format is a miss
FORMAT = "specdec-layers-1"
#: the fields of one layer's state, per kind of layer (an int8 W8A8 layer, a 4-bit layer): the ones
#: it always has, and the ones it has where it has them
REQUIRED = {
    "w8a8": {"packed": torch.int8, "comp": torch.int32, "col": torch.float32, "scales": torch.float64},
    "q4": {"q4_packed": torch.uint8, "q4_gain": torch.float32, "q4_col": torch.float32},
}
OPTIONAL = {"w8a8": {"bias": torch.float32, "inv_smooth": torch.float32},
            "q4": {"bias": torch.float32, "q6_packed": torch.uint8}}


def kind(fields: dict[str, Tensor]) -> str:
    """Which kind of layer a state's fields describe."""
    return "q4" if "q4_packed" in fields else "w8a8"


def cache_dir() -> Path | None:
    """Where entries live, or None when the cache is off."""
    from specdec import caches

    return caches.quantised_dir()


#: bytes per group of 32 columns and block of 32 inputs in the 4-bit kernel's packings (``csrc/q4.cpp``)
_GROUP_BYTES = {"q4_packed": 640, "q6_packed": 896}


def _covers(field: str, groups: int, fields: dict[str, Tensor], out: int) -> bool:
    """Whether ``groups`` groups of 32 columns in ``field`` are what a layer of ``out`` outputs
    packs there: the 4-bit columns come first in whole groups (all of them, the last group padded,
    where there are no Q6_K ones), the Q6_K columns after them."""
    if "q6_packed" not in fields:
        return groups == -(-out // 32)
    if field == "q4_packed":
        return True  # checked with the Q6_K packing's, which must cover the columns after these
    q4 = fields["q4_packed"]  # (a kind "q4" layer always has it: empty where every column is Q6_K)
    n4 = 32 * q4.shape[0] if q4.dim() == 3 else 0
    return groups == -(-(out - n4) // 32)


def _fits(state: dict[str, Tensor], shapes: dict[str, tuple[int, int]]) -> bool:
    """Whether ``state`` holds exactly the layers ``shapes`` names (layer -> (outputs, inputs)),
    each with the fields of its kind, no unknown one, the right dtypes and sizes that match its shape."""
    layers: dict[str, dict[str, Tensor]] = {}
    for name, t in state.items():
        layer, _, field = name.rpartition(".")
        layers.setdefault(layer, {})[field] = t
    if set(layers) != set(shapes):
        return False
    for layer, fields in layers.items():
        layer_kind = kind(fields)
        allowed = REQUIRED[layer_kind] | OPTIONAL[layer_kind]
        if not set(REQUIRED[layer_kind]) <= set(fields) or any(allowed.get(f) != t.dtype for f, t in fields.items()):
            return False
        out, k = shapes[layer]
        for field, t in fields.items():
            if field == "packed":  # [groups, in / 4, group width, 4]
                ok = t.dim() == 4 and t.shape[3] == 4 and t.shape[0] * t.shape[2] >= out and t.shape[1] * 4 >= k
            elif field == "q4_packed" and "q6_packed" in fields and t.numel() == 0:
                ok = True  # every column Q6_K
            elif field in ("q4_packed", "q6_packed"):  # [column groups, in / 32, bytes per group and block]
                ok = (t.dim() == 3 and t.shape[2] == _GROUP_BYTES[field] and _covers(field, t.shape[0], fields, out)
                      and t.shape[1] * 32 >= k > (t.shape[1] - 1) * 32)
            elif field in ("q4_gain", "q4_col"):  # empty where there is none
                ok = t.dim() == 1 and t.numel() in (0, k if field == "q4_gain" else out)
            else:
                ok = t.dim() == 1 and t.numel() == (k if field == "inv_smooth" else out)
            if not ok:
                return False
    return True


def load(name: str, shapes: dict[str, tuple[int, int]]) -> dict[str, Tensor] | None:
    """Entry ``name``'s layer states (``LAYER.FIELD`` -> tensor) when they fit ``shapes``, else None."""
    folder = cache_dir()
    if folder is None:
        return None
    from safetensors import safe_open

    path = folder / f"{name}.safetensors"
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("format") != FORMAT:
                return None
            state = {k: f.get_tensor(k) for k in f.keys()}
    except Exception:  # noqa: BLE001 - missing, truncated, or not ours: build the model again
        return None
    if not _fits(state, shapes):
        return None
    try:
        os.utime(path)  # used now: the last to go when a new entry needs the room
    except OSError:
        pass
    return state


def save(name: str, state: dict[str, Tensor]) -> bool:
    """Store ``state`` as entry ``name`` (best effort: a full or read-only disk only costs the next
    start), keeping the :data:`KEEP` most recently used entries (written, or read by :func:`load`).
    True when it was written."""
    folder = cache_dir()
    if folder is None:
        return False
    from safetensors.torch import save_file

    tmp = folder / f"{name}.{os.getpid()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        size = sum(t.numel() * t.element_size() for t in state.values())
        if shutil.disk_usage(folder).free < size + FREE_MARGIN:
            return False
        save_file({k: t.contiguous() for k, t in state.items()}, str(tmp), metadata={"format": FORMAT})
        tmp.replace(folder / f"{name}.safetensors")
        entries = sorted(folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime_ns)
        for old in entries[: max(0, len(entries) - KEEP)]:
            old.unlink(missing_ok=True)
        return True
    except Exception:  # noqa: BLE001 - a cache that cannot be written must never fail a model's load
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return False
