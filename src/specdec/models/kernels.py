"""C++ kernels compiled on first use for the CPU they run on (``csrc/``).

* ``torch.ops.specdec.q8_linear`` (``csrc/q8.cpp``): fbgemm's dynamic int8 product, bitwise, for
  the few rows a decoding step or a verification pass has, with the int8 weights streamed once for
  up to four rows (VNNI dot products) or three (AVX2 pair products).  :class:`~specdec.models.linear.W8A8Linear`
  takes it for small row counts where the build quantises activations as fbgemm does on this CPU
  (8-bit with 512-bit VNNI, 7-bit on AVX2 without VNNI: :func:`q8_zero`); since its output is
  bitwise fbgemm's, which kernel runs a product never changes a result.
* ``torch.ops.specdec.q4_linear`` (``csrc/q4.cpp``): GGUF's Q4_1 weights (and any Q6_K columns
  after them) as shipped times activations quantised to 8 bits per block of 32
  (:class:`~specdec.models.linear.Q4Linear`); every row's result depends on that row alone.
  Without the library the same bits come from ATen ops (:func:`~specdec.models.linear.q4_reference`,
  :func:`~specdec.models.linear.q6_reference`), much more slowly.
* ``torch.ops.specdec.f32_linear`` (``csrc/f32.cpp``): the batch-invariant float32 target's
  product, each row summed in a fixed order; it replaces oneDNN for such targets
  (:class:`~specdec.models.linear.Linear`), whose bits differ: a process uses one or the other
  for every product (``SPECDEC_F32_KERNEL=0`` keeps oneDNN).
* ``torch.ops.specdec.fused_layers`` (``csrc/layers.cpp``): a quantised model's whole layer loop
  (4-bit layers, W8A8 layers on the few-row kernel) for a decoding step, a chain or tree
  verification pass or a batching server's pass (``fused_layers_batch``) in one call — bitwise the TorchScript loop (:mod:`specdec.models.scripted`),
  without its ~25 interpreted ATen calls per layer.
* ``torch.ops.specdec.attend`` (``csrc/attention.cpp``): the batch-invariant target's exact
  attention — each query row over its own keys with a reduction order fixed by those keys, the
  same bits alone, in a verification pass of any size or as a tree node (over its path, read in
  place: no cache shuffling).  It replaces the blocked ATen computation (``native._attend_rows``),
  whose bits differ: a process uses one or the other for every pass (``attention_kernel()``).
  ``attend_batch`` runs several sequences' rows, each against its own cache, in one parallel
  region, each row bitwise what ``attend`` gives it alone (a batching server's pass).
* ``torch.ops.specdec.sample_weights``, ``draw_scattered`` and ``chain_rule``
  (``csrc/rules.cpp``): a draw from a row of weights, a draft's draw from a reduced-vocabulary row
  with its scatter into the whole vocabulary, and token / block verification of a chain at T > 0,
  each in one call instead of up to ~25 ATen calls (each of which costs ~40-60 us more right after
  a target pass than warm); the draws are bitwise the torch version's, the rules too except block
  verification's thresholds, whose masses are summed in float64 (see the source).  Used by
  :func:`specdec.sampling.sample_categorical`, :class:`specdec.drafters.base.DraftSampler` and
  :mod:`specdec.verify` once a model has loaded the library (``loaded()``).
* ``torch.ops.specdec.keyed_uniform`` and ``gumbel_argmax`` (``csrc/keyed.cpp``): seeded
  sampling's keyed uniforms (bitwise the torch version's), and its Gumbel-max draw in one pass
  (:func:`specdec.sampling.gumbel_sample`), answered only when the winner leads by a margin no
  rounding of the torch version's logarithms can close, so the token is the torch version's.

The sources are compiled with the system's C++ compiler (``$CXX``, ``c++``, ``g++`` or
``clang++``) against the installed torch, once per source / torch / CPU combination, into
``$SPECDEC_CACHE`` (default ``~/.cache/specdec``); later processes load the cached library in
well under a second.  Without a compiler (or with ``SPECDEC_KERNELS=0``) the ops are declared but
not implemented: products stay on fbgemm / oneDNN (the same bits) and attention on ATen ops (its
own bits, consistently); both slower.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

from specdec import caches
from specdec.outputs import write_whole

_SOURCES = tuple(Path(__file__).parent / "csrc" / name for name in ("q8.cpp", "q4.cpp", "f32.cpp", "attention.cpp", "layers.cpp", "keyed.cpp", "rules.cpp"))
_HEADERS = (Path(__file__).parent / "csrc" / "specdec.h",)
_FLAGS = ("-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-fno-fast-math", "-DNDEBUG")
#: the ops' schemas, declared in Python when the library cannot be built, so TorchScript code that
#: names them still compiles (it never calls them then)
_SCHEMAS = (
    "q8_pack(Tensor w) -> Tensor",
    "q8_linear(Tensor x, Tensor? smooth, Tensor packed, Tensor comp, Tensor col) -> (Tensor, Tensor)",
    "q8_supported() -> bool",
    "q8_zero() -> int",
    "attend(Tensor q, Tensor k, Tensor v, int start, Tensor? paths=None) -> Tensor",
    "attend_batch(Tensor q, Tensor[] k, Tensor[] v, int[] starts, int[] sizes) -> Tensor",
    "q4_pack(Tensor qs, Tensor d, Tensor m) -> Tensor",
    "q4_linear(Tensor x, Tensor gain, Tensor packed, int n_out, Tensor col, Tensor? packed6=None) -> Tensor",
    "q6_pack(Tensor codes, Tensor d, Tensor sc) -> Tensor",
    "q4_isa() -> str",
    "keyed_uniform(int key, Tensor? ids, int vocab) -> Tensor",
    "gumbel_argmax(Tensor probs, int key, Tensor? ids=None, int vocab=0) -> int",
    "f32_pack(Tensor w) -> Tensor",
    "f32_linear(Tensor x, Tensor packed, int n_out) -> Tensor",
)
# (fused_layers and fused_layers_batch are not declared there: they take a torch.classes.specdec.FusedWeights,
# a class only the built library defines, and only Python code that checked the library loaded calls them)
_state: dict[str, object] = {}


def _cpu_key() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        found = shutil.which(name) if name else None
        if found:
            return found
    return None


def _march() -> str:
    """The target-CPU flag: this CPU (``-march=native``), or ``-march=$SPECDEC_MARCH`` (e.g.
    ``x86-64-v3`` for AVX2, ``x86-64`` for the portable C++ paths: how the tests check that every
    build gives the same bits)."""
    if os.environ.get("SPECDEC_MARCH"):
        return f"-march={os.environ['SPECDEC_MARCH']}"
    return "-march=native" if platform.machine() in ("x86_64", "AMD64") else "-mcpu=native"


def compile_command(cxx: str, sources, out: Path) -> list[str]:
    """The command that compiles ``sources`` into the shared library ``out`` against the installed
    torch: the kernels' build, and the tests' probe of the toolchain with a one-op source."""
    # imported only to compile: it brings setuptools in, ~0.25 s of every start-up on a cache hit
    from torch.utils import cpp_extension

    return [cxx, *_FLAGS, _march(), *(f"-I{p}" for p in cpp_extension.include_paths()),
            f"-I{sysconfig.get_paths()['include']}", *map(str, sources), "-o", str(out),
            *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu", "-ltorch"]


def _build(cxx: str) -> Path:
    src = b"\0".join(p.read_bytes() for p in (*_SOURCES, *_HEADERS))
    march = _march()
    key = hashlib.sha256(b"\0".join([src, torch.__version__.encode(), cxx.encode(), _cpu_key().encode(),
                                     " ".join((*_FLAGS, march)).encode()])).hexdigest()[:16]
    cache = caches.root() / "kernels"
    cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"specdec-{key}.so"
    if lib.is_file():
        return lib
    with open(cache / f"specdec-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one compile when several processes start at once
        if lib.is_file():
            return lib

        def compile_to(tmp: Path) -> None:  # (interrupted: subprocess.run kills the compiler)
            subprocess.run(compile_command(cxx, _SOURCES, tmp), check=True, capture_output=True, text=True)

        print("[specdec] compiling the float32, int8, 4-bit and attention kernels for this CPU (once, ~30 s) ...", file=sys.stderr)
        write_whole(lib, compile_to)  # under the lock; an interrupted or failed compile leaves no half-written library
    return lib


def _declare() -> None:
    lib = torch.library.Library("specdec", "DEF")  # noqa: TOR901 - schemas only, no implementation
    for schema in _SCHEMAS:
        lib.define(schema)
    _state["stub"] = lib  # keep the registration alive


def load() -> bool:
    """Load (compiling on the first call on this machine) the kernels; declare their schemas only
    where that fails.  Returns whether they are implemented.  Once per process."""
    if "loaded" in _state:
        return bool(_state["loaded"])
    ok = False
    if os.environ.get("SPECDEC_KERNELS", "1") != "0":
        cxx = _compiler()
        if cxx is None:
            print("[specdec] warning: no C++ compiler found; int8 products and attention stay on ATen ops (slower)",
                  file=sys.stderr)
        else:
            try:
                lib = _build(cxx)
                torch.ops.load_library(str(lib))
                _state["library"] = lib.name  # names its sources, torch, compiler, CPU and flags (a hash)
                ok = True
            except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
                detail = (getattr(e, "stderr", "") or str(e)).strip().splitlines()
                detail = [line for line in detail if "error" in line][:1] or detail[-1:]  # the first error, not a caret line
                print(f"[specdec] warning: the kernels did not build ({detail[0][:200] if detail else e}); "
                      "int8 products and attention stay on ATen ops (slower)", file=sys.stderr)
    if not ok:
        _declare()
    _state["loaded"] = ok
    return ok


def loaded() -> bool:
    """Whether the kernels are loaded and implemented in this process, without loading (or
    compiling) them: for helpers such as seeded sampling that use a kernel only where a model
    already brought the library in."""
    return bool(_state.get("loaded"))


def library() -> str | None:
    """The loaded library's file name — a hash of its sources, torch, compiler, CPU and flags —
    or None where the kernels are not implemented in this process (without loading them)."""
    return _state.get("library") if loaded() else None


def q8_available() -> bool:
    """Whether ``torch.ops.specdec.q8_linear`` runs here with 8-bit activations (the library loaded
    and the CPU and build have 512-bit VNNI): where int8 layers run as fast as the 4-bit ones."""
    if "q8" not in _state:
        _state["q8"] = load() and bool(torch.ops.specdec.q8_supported())
    return bool(_state["q8"])


def q8_zero() -> int:
    """The activations' zero point ``torch.ops.specdec.q8_linear`` quantises with in this build:
    128 (512-bit VNNI, fbgemm's 8-bit activations), 64 (AVX2, fbgemm's 7-bit ``reduce_range``), 0
    where the product is absent (no library, or neither ISA)."""
    if "q8_zero" not in _state:
        _state["q8_zero"] = int(torch.ops.specdec.q8_zero()) if load() else 0
    return int(_state["q8_zero"])


def q4_available() -> bool:
    """Whether ``torch.ops.specdec.q4_linear`` runs here (the library loaded; AVX-512 VNNI, AVX2
    or portable C++, the same bits every way)."""
    return load()


def q4_fast() -> bool:
    """Whether the 4-bit kernel runs vectorised here (AVX-512 VNNI or AVX2; its portable C++ path
    gives the same bits several times more slowly)."""
    if "q4_fast" not in _state:
        _state["q4_fast"] = load() and str(torch.ops.specdec.q4_isa()) != "portable"
    return bool(_state["q4_fast"])


def attention_kernel() -> bool:
    """Whether exact attention runs on ``torch.ops.specdec.attend`` in this process (the library
    loaded; ``SPECDEC_ATTENTION=0`` keeps the ATen computation).  Fixed for the process's lifetime:
    every pass of a batch-invariant model must compute attention the same way."""
    if "attend" not in _state:
        _state["attend"] = load() and os.environ.get("SPECDEC_ATTENTION", "1") != "0"
    return bool(_state["attend"])


def set_attention_kernel(on: bool) -> None:
    """For paired measurements only (``scripts/kernel_ab.py``): use the attention kernel (where
    it loaded) or ATen ops for the passes that follow.  Only between sequences: the two round
    differently, so every key and value in one cache must come from the same one."""
    _state["attend"] = bool(on) and load()
