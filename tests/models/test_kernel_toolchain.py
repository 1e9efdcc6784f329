"""The compiled kernels build wherever the toolchain can build a torch extension at all.

Where the kernels do not build, every test of them skips and the suite passes on the ATen paths:
right for a machine without a compiler or without Python's headers, wrong for a source that no
longer compiles, which would then pass CI unseen.  So a failed build is told apart here: a one-op
extension is compiled with the same compiler, flags, include and library paths; if that builds and
the kernels do not, the fault is in the kernels' sources, and the test fails with the compiler's
last lines.

The loader's answers are pinned here too, without compiling anything (a fresh process state and a
faked compiler): what each kernel reports with and without the library, the switches, the
compiler's choice and the build cache's key (sources, header and target CPU).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specdec.models import kernels

_PROBE = """
#include <ATen/ATen.h>
#include <torch/library.h>

static at::Tensor twice(const at::Tensor& x) { return x * 2; }

TORCH_LIBRARY(specdec_probe, m) { m.def("twice(Tensor x) -> Tensor", &twice); }
"""


def _probe_error(cxx: str, folder: Path) -> str | None:
    """None where a one-op torch extension compiles and links with the kernels' command, else why not."""
    src = folder / "probe.cpp"
    src.write_text(_PROBE)
    done = subprocess.run(kernels.compile_command(cxx, [src], folder / "probe.so"), capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["(no output)"])[-1]


def _last_lines(e: subprocess.CalledProcessError) -> str:
    return "\n".join((e.stderr or "").strip().splitlines()[-15:])


def test_the_kernels_build_where_a_torch_extension_builds(tmp_path: Path) -> None:
    """Loaded, or no compiler / switched off (skip), or the toolchain itself cannot build a
    one-op extension (skip, naming why); a toolchain that builds the probe but not the kernels fails."""
    if kernels.load():
        return
    cxx = kernels._compiler()
    if os.environ.get("SPECDEC_KERNELS", "1") == "0" or cxx is None:
        pytest.skip("the kernels are switched off (SPECDEC_KERNELS=0) or no C++ compiler is found")
    why = _probe_error(cxx, tmp_path)
    if why is not None:
        pytest.skip(f"this toolchain cannot build a torch extension at all: {why}")
    try:
        kernels._build(cxx)
    except subprocess.CalledProcessError as e:
        pytest.fail(f"a one-op torch extension builds here, the kernels' sources do not:\n{_last_lines(e)}")
    pytest.fail("the kernels build here but did not load in this process (see the warning it printed)")


def test_the_probe_builds_with_this_toolchain(tmp_path: Path) -> None:
    """Where the kernels loaded, the probe builds too (else the test above would skip a real failure)."""
    if not kernels.load():
        pytest.skip("the kernels are not built here")
    assert _probe_error(kernels._compiler(), tmp_path) is None


def test_a_failed_build_is_reported_by_its_first_error(monkeypatch, capsys) -> None:
    """The warning quotes the compiler's first error line, not its last line (a caret under code)."""
    def failing(cxx: str) -> Path:
        raise subprocess.CalledProcessError(1, [cxx], stderr="In file included from q4.cpp:1:\n"
                                            "q4.cpp:3:1: error: 'x' was not declared\n    3 | x\n      | ^\n")

    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "_compiler", lambda: "c++")
    monkeypatch.setattr(kernels, "_build", failing)
    monkeypatch.setattr(kernels, "_declare", lambda: None)  # the real schemas are declared already
    monkeypatch.delenv("SPECDEC_KERNELS", raising=False)
    assert kernels.load() is False
    assert "did not build (q4.cpp:3:1: error: 'x' was not declared)" in capsys.readouterr().err


@pytest.fixture
def fresh(monkeypatch):
    """A process-state as if nothing were loaded yet; ``set(ok)`` makes load() answer ``ok``."""
    state: dict = {}
    monkeypatch.setattr(kernels, "_state", state)

    def set_loaded(ok: bool) -> dict:
        state["loaded"] = ok
        return state

    return set_loaded


def test_without_the_library_every_kernel_answers_absent(fresh, monkeypatch):
    """No library: no q8 product (zero point 0), no 4-bit kernel, ATen attention, not loaded, no name;
    switching the attention kernel on cannot turn it on."""
    fresh(False)
    monkeypatch.delenv("SPECDEC_ATTENTION", raising=False)
    assert kernels.loaded() is False and kernels.library() is None
    assert kernels.q8_zero() == 0 and kernels.q8_available() is False
    assert kernels.q4_available() is False and kernels.q4_fast() is False
    assert kernels.attention_kernel() is False
    kernels.set_attention_kernel(True)
    assert kernels.attention_kernel() is False


def test_loaded_does_not_assume_a_load(fresh):
    """Before any load() in the process, loaded() is False (it never loads or compiles)."""
    assert kernels.loaded() is False and kernels.library() is None


def test_the_library_name_is_reported_only_when_loaded(fresh):
    state = fresh(False)
    state["library"] = "specdec-0123.so"
    assert kernels.library() is None
    state["loaded"] = True
    assert kernels.library() == "specdec-0123.so"


@pytest.mark.skipif(not kernels.load(), reason="needs the compiled kernels (a C++ compiler)")
def test_availability_follows_the_loaded_library(fresh, monkeypatch):
    """With the library: attention on unless SPECDEC_ATTENTION=0; q4_fast is 'not portable'."""
    fresh(True)
    monkeypatch.delenv("SPECDEC_ATTENTION", raising=False)
    assert kernels.attention_kernel() is True
    assert kernels.q4_fast() == (str(torch.ops.specdec.q4_isa()) != "portable")
    assert kernels.q8_zero() == int(torch.ops.specdec.q8_zero())
    fresh(True).clear()
    fresh(True)
    monkeypatch.setenv("SPECDEC_ATTENTION", "0")
    assert kernels.attention_kernel() is False


def test_cxx_is_the_first_choice_of_compiler(monkeypatch):
    monkeypatch.setenv("CXX", "sh")  # any program on PATH: it is only looked up
    assert kernels._compiler() == shutil.which("sh")


def _fake_builds(monkeypatch, tmp_path) -> list[list[str]]:
    """_build with a 'compiler' that writes an empty library: the commands it was given."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    commands: list[list[str]] = []

    def run(cmd, **kwargs):
        commands.append(cmd)
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"")

    monkeypatch.setattr(kernels.subprocess, "run", run)
    return commands


def test_each_target_cpu_flag_gets_its_own_library(monkeypatch, tmp_path):
    """SPECDEC_MARCH reaches the compiler and the cache key: an x86-64 build never answers for a native one."""
    commands = _fake_builds(monkeypatch, tmp_path)
    monkeypatch.setenv("SPECDEC_MARCH", "x86-64")
    portable = kernels._build("c++")
    assert "-march=x86-64" in commands[-1]
    monkeypatch.setenv("SPECDEC_MARCH", "x86-64-v3")
    avx2 = kernels._build("c++")
    assert "-march=x86-64-v3" in commands[-1]
    assert portable != avx2 and len(commands) == 2
    assert kernels._build("c++") == avx2 and len(commands) == 2  # cached: not compiled again


def test_a_changed_header_is_a_new_library(monkeypatch, tmp_path):
    """The cache key covers the shared header as well as the sources."""
    _fake_builds(monkeypatch, tmp_path / "cache")
    header = tmp_path / "specdec.h"
    header.write_text("// one\n")
    monkeypatch.setattr(kernels, "_HEADERS", (header,))
    first = kernels._build("c++")
    header.write_text("// two\n")
    assert kernels._build("c++") != first


def test_a_loaded_library_without_the_few_row_int8_product_reports_none(fresh, monkeypatch):
    """q8_available() is the library loaded AND its q8_supported(): a build without VNNI says no."""
    ops = SimpleNamespace(q8_supported=lambda: False, q8_zero=lambda: 0, q4_isa=lambda: "portable")
    monkeypatch.setattr(kernels, "torch", SimpleNamespace(ops=SimpleNamespace(specdec=ops)))
    fresh(True)
    assert kernels.q8_available() is False and kernels.q4_fast() is False and kernels.q8_zero() == 0


def test_the_cpu_key_is_the_cpuinfo_flags_line():
    """A library compiled with -march=native answers only for CPUs with the same flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo here")
    flags = [line for line in text.splitlines() if line.startswith("flags")]
    if not flags:
        pytest.skip("/proc/cpuinfo has no flags line here")
    assert kernels._cpu_key() == flags[0]


def test_the_cache_key_covers_torch_and_the_compiler(monkeypatch, tmp_path):
    """Another torch version or another compiler is another library (compiled, not reused)."""
    commands = _fake_builds(monkeypatch, tmp_path)
    monkeypatch.delenv("SPECDEC_MARCH", raising=False)
    first = kernels._build("c++")
    assert kernels._build("g++") != first
    monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    assert kernels._build("c++") != first
    assert len(commands) == 3


def test_the_cache_key_covers_the_cpu(monkeypatch, tmp_path):
    _fake_builds(monkeypatch, tmp_path)
    monkeypatch.setattr(kernels, "_cpu_key", lambda: "flags : avx2")
    first = kernels._build("c++")
    monkeypatch.setattr(kernels, "_cpu_key", lambda: "flags : avx2 avx512f")
    assert kernels._build("c++") != first


def test_a_library_finished_while_waiting_for_the_lock_is_not_compiled_again(monkeypatch, tmp_path):
    """Several processes start at once: the ones that waited for the lock find the first one's library."""
    commands = _fake_builds(monkeypatch, tmp_path)
    done: list[Path] = []

    def flock(lock, op):  # another process compiles while this one waits
        lib = Path(lock.name).with_suffix(".so")
        lib.write_bytes(b"the other process's library")
        done.append(lib)

    monkeypatch.setattr(kernels.fcntl, "flock", flock)
    lib = kernels._build("c++")
    assert done == [lib] and commands == []
    assert lib.read_bytes() == b"the other process's library"


def test_the_target_cpu_flag_is_march_on_x86_and_mcpu_elsewhere(monkeypatch):
    monkeypatch.delenv("SPECDEC_MARCH", raising=False)
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    assert kernels._march() == "-march=native"
    monkeypatch.setattr(kernels.platform, "machine", lambda: "aarch64")
    assert kernels._march() == "-mcpu=native"
    monkeypatch.setenv("SPECDEC_MARCH", "x86-64-v3")
    assert kernels._march() == "-march=x86-64-v3"


@pytest.fixture
def failing_load(monkeypatch):
    """A fresh process state whose _declare is recorded, not run (the real schemas are declared already)."""
    declared: list[bool] = []
    monkeypatch.setattr(kernels, "_state", {})
    monkeypatch.setattr(kernels, "_declare", lambda: declared.append(True))
    monkeypatch.delenv("SPECDEC_KERNELS", raising=False)
    return declared


def test_no_compiler_declares_the_schemas_and_warns(failing_load, monkeypatch, capsys):
    monkeypatch.setattr(kernels, "_compiler", lambda: None)
    assert kernels.load() is False and kernels.loaded() is False
    assert failing_load == [True]
    assert "no C++ compiler found" in capsys.readouterr().err


def test_a_library_that_will_not_load_leaves_the_aten_paths(failing_load, monkeypatch, capsys):
    """An OSError (the library cannot be opened or the cache cannot be written) is a warning, not a crash."""
    def broken(cxx: str) -> Path:
        raise OSError("specdec-0123.so: cannot open shared object file")

    monkeypatch.setattr(kernels, "_compiler", lambda: "c++")
    monkeypatch.setattr(kernels, "_build", broken)
    assert kernels.load() is False
    assert failing_load == [True]
    assert "did not build (specdec-0123.so: cannot open shared object file)" in capsys.readouterr().err


def test_a_failed_compile_declares_the_schemas_and_quotes_the_first_of_several_errors(failing_load, monkeypatch, capsys):
    def failing(cxx: str) -> Path:
        raise subprocess.CalledProcessError(1, [cxx], stderr="q4.cpp:3:1: error: 'x' was not declared\n"
                                            "q4.cpp:9:1: error: 'y' was not declared\n    9 | y\n      | ^\n")

    monkeypatch.setattr(kernels, "_compiler", lambda: "c++")
    monkeypatch.setattr(kernels, "_build", failing)
    assert kernels.load() is False
    assert failing_load == [True]
    assert "did not build (q4.cpp:3:1: error: 'x' was not declared)" in capsys.readouterr().err


def test_only_specdec_attention_0_switches_the_attention_kernel_off(monkeypatch):
    """With the library loaded, any other value (here 'yes') keeps the kernel on."""
    monkeypatch.setattr(kernels, "_state", {"loaded": True})
    monkeypatch.setenv("SPECDEC_ATTENTION", "yes")
    assert kernels.attention_kernel() is True


def test_q8_is_absent_without_the_library_whatever_the_op_would_say(monkeypatch):
    """q8_available() asks the op only where the library loaded (a declared-only op has no answer)."""

    ops = SimpleNamespace(q8_supported=lambda: True, q8_zero=lambda: 128, q4_isa=lambda: "avx512")
    monkeypatch.setattr(kernels, "torch", SimpleNamespace(ops=SimpleNamespace(specdec=ops)))
    monkeypatch.setattr(kernels, "_state", {"loaded": False})
    assert kernels.q8_available() is False and kernels.q8_zero() == 0 and kernels.q4_fast() is False


@pytest.mark.skipif(not kernels.load(), reason="needs the compiled kernels (a C++ compiler)")
def test_the_reported_library_is_its_file_name():
    """library() names the file (the hash of sources, torch, compiler, CPU and flags), not a path."""
    import re

    assert re.fullmatch(r"specdec-[0-9a-f]{16}\.so", kernels.library() or "")
