"""The compiled kernels build wherever the toolchain can build a torch extension at all.

Where the kernels do not build, every test of them skips and the suite passes on the ATen paths:
right for a machine without a compiler or without Python's headers, wrong for a source that no
longer compiles, which would then pass CI unseen.  So a failed build is told apart here: a one-op
extension is compiled with the same compiler, flags, include and library paths; if that builds and
the kernels do not, the fault is in the kernels' sources, and the test fails with the compiler's
last lines.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

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
