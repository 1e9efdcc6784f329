"""A loaded model's weights moved onto transparent huge pages (Linux).

Decoding streams every layer weight of the model once per forward pass: ~95 MB for the 4-bit
SmolLM2 with its int8 head.  On 4 KiB pages that is ~24,000 pages a pass, far more than the CPU's
TLB holds, so the pass pays a page walk every 4 KiB it reads.  On 2 MiB pages the same weights
are ~50 pages.  (The slowness of the first ops after a pass is not this: it stayed the same on
huge pages.)  Where the kernel's transparent huge pages are ``madvise`` (a common default) nothing gets
them unless asked, so :func:`adopt` asks: it copies every large tensor a model holds (64 KiB or more) into one
anonymous mapping advised ``MADV_HUGEPAGE`` and points the tensors at the copy (``Tensor.set_``:
the same tensor objects, the same bits, the same strides; every holder sees the move).  The old
buffers are freed as the last reference to them goes, so the peak during the move is one model's
large tensors twice; the copy costs ~0.15 s for the 4-bit SmolLM2 on two Zen 3 cores.

Measured on a 2-core AMD EPYC (Zen 3), SmolLM2-135M q4: see NOTES.md, "Weights on huge pages".
Switched off with ``SPECDEC_HUGE_PAGES=0``; a no-op where the platform has no ``MADV_HUGEPAGE``
or the kernel's setting is ``never``.
"""

from __future__ import annotations

import mmap
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KiB granule) transparent huge page
MIN_BYTES = 64 << 10  # storages smaller than this stay where they are (norms, biases, tables)
ALIGN = 4096  # each storage's place in the mapping: packed, page-aligned (torch's allocator gives 64 bytes)
_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_setting() -> str | None:
    """The kernel's transparent huge page mode (``always`` | ``madvise`` | ``never``), or None
    where it cannot be read (not Linux, or no THP support)."""
    try:
        text = _SETTING.read_text()
    except OSError:
        return None
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def available() -> bool:
    """Whether :func:`adopt` would move anything here: ``MADV_HUGEPAGE`` exists, the kernel's
    setting allows it, and ``SPECDEC_HUGE_PAGES`` is not ``0``."""
    if os.environ.get("SPECDEC_HUGE_PAGES", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return hasattr(mmap, "MADV_HUGEPAGE") and thp_setting() in ("always", "madvise")


def ours(obj: object) -> bool:
    """Whether :func:`tensors_of` looks inside ``obj``'s attributes: specdec's objects and torch
    modules (not a tokenizer, a config or a library's handle, nor an :class:`Arena`)."""
    return ((type(obj).__module__ or "").startswith("specdec") or isinstance(obj, torch.nn.Module)) \
        and not isinstance(obj, Arena)


def _plain(t: Tensor) -> bool:
    """A dense CPU tensor over a storage of its own kind: not oneDNN's opaque layout (a packed
    weight, which has no storage to read), quantised, sparse or on another device."""
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_mkldnn and not t.is_quantized
            and not t.is_sparse)


def tensors_of(root: Any, enter: Callable[[object], bool] = ours) -> Iterator[Tensor]:
    """Every dense CPU tensor (see :func:`_plain`) reachable from ``root`` through attributes (``__dict__`` and ``__slots__``)
    of the objects ``enter`` admits, and through lists, tuples, sets and dicts; each object once."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            if _plain(obj):
                yield obj
            continue
        if isinstance(obj, dict):
            stack.extend(obj.values())
            continue
        if isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
            continue
        if not enter(obj):
            continue
        stack.extend(getattr(obj, "__dict__", {}).values())
        for cls in type(obj).__mro__:
            for name in getattr(cls, "__slots__", ()):
                stack.append(getattr(obj, name, None))


@dataclass(eq=False)  # compared and hashed by identity (kept in a WeakSet)
class Arena:
    """The mapping a model's large tensors were moved into (kept alive by whoever keeps the model)."""

    mapping: mmap.mmap
    buffer: Tensor  # uint8 over the whole mapping
    moved_bytes: int
    tensors: int
    storages: int


_ARENAS: weakref.WeakSet[Arena] = weakref.WeakSet()  # every live arena, so that nothing moves twice


def adopt(root: Any, *, min_bytes: int = MIN_BYTES, skip: Sequence[Tensor] = (),
          enter: Callable[[object], bool] = ours) -> Arena | None:
    """Move the large tensors reachable from ``root`` (see :func:`tensors_of`) onto huge pages.

    Tensors are grouped by the storage they view, each storage copied once to a page-aligned place
    of one ``MADV_HUGEPAGE`` mapping (packed from a 2 MiB boundary on), and every tensor of the group set to view the copy at
    its own offset, size and strides.  Returns the arena (also kept on ``root`` as
    ``_huge_pages`` when ``root`` takes attributes), or None when nothing moved: huge pages are
    not available (:func:`available`), the kernel refused the advice, or no tensor is that large.
    Storages that a tensor requiring grad views are left alone, whole (a model being trained: a
    non-grad view of a parameter must keep sharing its memory), and so are the storages of
    ``skip`` (tables a pass reads a few rows of, such as the embedding: copying them costs start-up
    time and buys nothing).
    """
    if not available():
        return None
    groups: dict[int, list[Tensor]] = {}
    placed = [(a.buffer.data_ptr(), a.buffer.data_ptr() + a.buffer.numel()) for a in list(_ARENAS)]
    cold = {t.untyped_storage().data_ptr() for t in skip}
    for t in tensors_of(root, enter):
        st = t.untyped_storage()
        if st.data_ptr() in cold or any(lo <= st.data_ptr() < hi for lo, hi in placed):  # skipped, or moved already
            continue
        if t.requires_grad:
            cold.add(st.data_ptr())
            groups.pop(st.data_ptr(), None)
        elif st.nbytes() >= min_bytes:
            groups.setdefault(st.data_ptr(), []).append(t)
    if not groups:
        return None
    sizes = {key: ts[0].untyped_storage().nbytes() for key, ts in groups.items()}
    total = sum(-(-n // ALIGN) * ALIGN for n in sizes.values())
    mapping = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages: the copy would buy nothing
        mapping.close()
        return None
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)  # [total + HUGE_PAGE]
    storage = buffer.untyped_storage()
    pos = (-buffer.data_ptr()) % HUGE_PAGE  # the mapping is page-aligned; its first huge page boundary
    moved = count = 0
    with torch.inference_mode():
        for key, ts in groups.items():
            n = sizes[key]
            old = torch.empty(0, dtype=torch.uint8).set_(ts[0].untyped_storage(), 0, (n,), (1,))  # [n] bytes
            buffer[pos : pos + n].copy_(old)
            for t in ts:
                e = t.element_size()
                t.set_(storage, (pos + t.storage_offset() * e) // e, t.size(), t.stride())
            moved += n
            count += len(ts)
            pos += -(-n // ALIGN) * ALIGN
    arena = Arena(mapping, buffer, moved, count, len(groups))
    _ARENAS.add(arena)
    try:
        root._huge_pages = arena
    except AttributeError:  # __slots__ without room: the caller keeps the arena
        pass
    return arena


def adopt_model(model: Any) -> Arena | None:
    """:func:`adopt` for a loaded native model: its layers and head, not its embedding table (of
    which a pass reads one row a token)."""
    embed = getattr(model, "embed", None)
    return adopt(model, skip=(embed,) if isinstance(embed, Tensor) else ())


def huge_bytes() -> int | None:
    """This process's anonymous memory on huge pages (``AnonHugePages`` of /proc/self/smaps_rollup),
    in bytes, or None where it cannot be read."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
