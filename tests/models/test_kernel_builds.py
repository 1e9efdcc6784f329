"""Every build of the compiled kernels gives the same bits.

The 4-bit product and exact attention have an AVX-512 path, an AVX2 path and a portable C++ path;
which one a process runs depends on the CPU it was compiled for.  Their results must not: a
row's bits are fixed by the row (see the sources' headers), so a model decodes the same tokens on
every machine.  Here the kernels are compiled again for ``x86-64-v3`` (the AVX2 paths, which an
AVX-512 machine would otherwise never run) and for baseline ``x86-64`` (the portable paths), in
child processes (``SPECDEC_MARCH``), and every case is compared bit for bit with this process's
build: 4-bit products of 1-8 rows with padded blocks, partial column groups, a gain and column
factors (and the AVX2 build's few-row int8 product against fbgemm with 7-bit activations); attention of head sizes 64 (the vector paths), 48 and 40 (the generic path with a
tail), one row and a verification pass, a tree's paths, over float32 and float16 caches (the
portable build widens float16 in software, the others with F16C instructions); a draw from a row of weights and token
verification of a chain (``csrc/rules.cpp``); seeded sampling's Gumbel-max draw, over a whole row and a
compact one (``csrc/keyed.cpp``); the float32 target's product (``csrc/f32.cpp``: an AVX-512
path and a portable one, which AVX2 machines run too), 1-9 rows with partial column groups; 4-bit
activations exactly half way between two 8-bit codes.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.models import kernels

pytestmark = pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or not kernels.load(),
    reason="the kernels' x86 builds need an x86-64 CPU and a C++ compiler",
)

# the cases, computed in this process and in each child (the same seeded inputs)
_CASES = r"""
import torch

def cases():
    ops = torch.ops.specdec
    g = torch.Generator().manual_seed(7)
    out = {}
    for n_out, k in ((64, 96), (50, 70), (200, 576)):
        nb = -(-k // 32)
        qs = torch.randint(0, 256, (n_out, nb, 16), dtype=torch.uint8, generator=g)
        d = (torch.rand(n_out, nb, generator=g) * 0.02).half()
        m = (-torch.rand(n_out, nb, generator=g) * 0.02).half()
        packed = ops.q4_pack(qs, d, m)
        gain, col = torch.rand(k, generator=g) + 0.5, torch.rand(n_out, generator=g) + 0.5
        for rows in (1, 3, 8):
            x = torch.randn(rows, k, generator=g) * 3
            x[0, :5] = 0.0  # a block with zeros
            out[f"q4 {n_out}x{k} rows {rows}"] = ops.q4_linear(x, torch.empty(0), packed, n_out, torch.empty(0))
            out[f"q4 {n_out}x{k} rows {rows} gain col"] = ops.q4_linear(x, gain, packed, n_out, col)
    for n4, n6, k in ((0, 40, 96), (32, 70, 256)):  # Q6_K columns, alone and after a 4-bit group
        nb = -(-k // 32)
        packed = torch.empty(0, dtype=torch.uint8)
        if n4:
            packed = ops.q4_pack(torch.randint(0, 256, (n4, nb, 16), dtype=torch.uint8, generator=g),
                                 (torch.rand(n4, nb, generator=g) * 0.02).half(), (-torch.rand(n4, nb, generator=g) * 0.02).half())
        codes = torch.randint(0, 64, (n6, nb, 32), dtype=torch.uint8, generator=g)
        sc = torch.randint(-128, 128, (n6, nb, 2), generator=g).to(torch.int8)
        packed6 = ops.q6_pack(codes, (torch.rand(n6, nb, generator=g) * 0.002).half(), sc)
        col = torch.rand(n4 + n6, generator=g) + 0.5
        for rows in (1, 3, 5, 8):
            x = torch.randn(rows, k, generator=g) * 3
            out[f"q6 {n4}+{n6}x{k} rows {rows}"] = ops.q4_linear(x, torch.empty(0), packed, n4 + n6, col, packed6)
    for d in (64, 48, 40):
        k = torch.randn(3, 96, d, generator=g)
        v = torch.randn(3, 96, d, generator=g)
        for rows, start in ((1, 0), (1, 70), (5, 41)):
            q = torch.randn(rows, 9, d, generator=g) * d ** -0.5
            out[f"attend d {d} rows {rows} start {start}"] = ops.attend(q, k, v, start, None)
        paths = torch.tensor([[60, -1, -1], [60, 61, -1], [60, 62, -1], [60, 61, 63]])
        q = torch.randn(4, 9, d, generator=g) * d ** -0.5
        out[f"attend d {d} tree"] = ops.attend(q, k, v, 60, paths)
        kh, vh = (k * 300).half(), v.half()  # a float16 cache, subnormal and large values among its keys
        kh[0, 0, :5] = torch.tensor([6e-8, -3e-6, 1e-5, 6e4, -0.0])
        out[f"attend d {d} float16 cache"] = ops.attend(q[:3] / 300, kh, vh, 41, None)
        out[f"attend d {d} float16 cache tree"] = ops.attend(q / 300, kh, vh, 60, paths)
    for width in (7, 16, 49152):  # arg-max rows: random, ties, a NaN after the maximum, signed zeros
        x = torch.randn(4, width, generator=g)
        x[1] = torch.randint(-2, 2, (width,), generator=g).float()
        x[2, width - 1] = float("nan")
        x[3] = 0.0
        x[3, ::2] = -0.0
        out[f"argmax_rows {width}"] = ops.argmax_rows(x)
    for n in (5, 513, 49152):  # a draw, and token verification (block's thresholds may round differently)
        w = torch.softmax(torch.randn(n, generator=g) * 4, -1)
        out[f"sample_weights {n}"] = torch.tensor([ops.sample_weights(w, u) for u in (0.0, 0.3, 0.7, 0.999999)])
        out[f"gumbel_argmax {n}"] = torch.tensor([ops.gumbel_argmax(w, key) for key in (0, 7, -3, 2**62 + 1)])
        ids = torch.randperm(3 * n, generator=g)[:n]  # a compact row: its columns keyed by these ids
        out[f"gumbel_argmax compact {n}"] = torch.tensor([ops.gumbel_argmax(w, key, ids, 3 * n) for key in (0, 7, -3, 2**62 + 1)])
        for gamma in (1, 4):
            p = torch.softmax(torch.randn(gamma + 1, n, generator=g) * 2, -1)
            qd = torch.softmax(torch.randn(gamma, n, generator=g) * 2, -1)
            tokens = torch.multinomial(qd, 1, generator=g).squeeze(1)
            for uniforms in (torch.zeros(gamma + 1, dtype=torch.float64), torch.rand(gamma + 1, generator=g, dtype=torch.float64)):
                kept, emitted, alpha_mean = ops.chain_rule(p, qd, tokens, uniforms, False)
                out[f"token rule {n} gamma {gamma} u {float(uniforms.sum()):.3f}"] = torch.cat(
                    [emitted.double(), torch.tensor([kept, alpha_mean], dtype=torch.float64)])
    g = torch.Generator().manual_seed(3)
    for n_out, k in ((200, 37), (64, 16), (7, 5), (130, 96)):  # float32: partial 64-column groups, 1-9 rows
        w = torch.randn(n_out, k, generator=g)
        x = torch.randn(9, k, generator=g) * (torch.rand(9, 1, generator=g) * 50 + 1e-3)
        packed = ops.f32_pack(w)
        for rows in (1, 2, 3, 4, 5, 9):
            out[f"f32 {n_out}x{k} rows {rows}"] = ops.f32_linear(x[:rows], packed, n_out)
    # 4-bit: blocks whose step is exactly 1 (max |x| = 127), every other value half way between two
    # codes (rounded half to even on every path: a portable std::round would round it away from zero)
    n_out, k = 40, 64
    qs = torch.randint(0, 256, (n_out, 2, 16), dtype=torch.uint8, generator=g)
    d = (torch.rand(n_out, 2, generator=g) * 0.02).half()
    m = (-torch.rand(n_out, 2, generator=g) * 0.02).half()
    packed = ops.q4_pack(qs, d, m)
    x = (torch.randint(-120, 120, (7, k), generator=g) + 0.5).float()
    x[:, 0], x[:, 32] = 127.0, -127.0
    for rows in (1, 3, 7):
        out[f"q4 ties rows {rows}"] = ops.q4_linear(x[:rows], torch.empty(0), packed, n_out, torch.empty(0))
    return out
"""

# the few-row int8 product's AVX2 build against fbgemm with 7-bit activations (``reduce_range``),
# in the child that has it: this build quantises activations as fbgemm does on CPUs without VNNI,
# so it cannot be compared with a VNNI build's bits, only with fbgemm's, which runs on any x86 CPU
_Q8 = r"""
import warnings
from specdec.models.linear import vnni_packing

def q8_mismatches():
    bad = []
    g = torch.Generator().manual_seed(11)
    for n_out, k in ((130, 70), (64, 576), (1000, 1536)):
        w = torch.randn(n_out, k + 2, generator=g) * 0.05
        w[:, k:] = 0.0  # the two pinned columns' weights
        w[3] *= 20
        scales = (w.abs().amax(1).clamp_min(1e-12) / 127.0).double()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scales, torch.zeros(n_out, dtype=torch.long), 0, torch.qint8)
        packed = torch.ops.quantized.linear_prepack(qw, None)
        mine = vnni_packing(qw.int_repr()[:, :k], scales)
        for rows in (1, 2, 3, 4, 7, 16):
            x = torch.randn(rows, k, generator=g) * (torch.rand(rows, 1, generator=g) * 10 + 0.01)
            x[:, k // 2] *= 40
            s = x.abs().amax(1, keepdim=True).clamp_min(1e-30)
            staged = torch.cat([x / s, torch.ones(rows, 1), -torch.ones(rows, 1)], 1)
            want = torch.ops.quantized.linear_dynamic(staged, packed, True)
            got, got_s = torch.ops.specdec.q8_linear(x, None, *mine)
            if not (torch.equal(got, want) and torch.equal(got_s, s)):
                bad.append(f"{n_out}x{k} rows {rows}: max |diff| {float((got - want).abs().max()):.3g}")
    return bad
"""

_CHILD = _CASES + _Q8 + r"""
import sys
from specdec.models import kernels
assert kernels.load(), "the kernels did not build"
zero = int(torch.ops.specdec.q8_zero())
torch.save({"isa": str(torch.ops.specdec.q4_isa()), "cases": cases(), "q8_zero": zero,
            "q8_mismatches": q8_mismatches() if zero == 64 else None}, sys.argv[1])
"""


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _here() -> dict[str, torch.Tensor]:
    scope: dict = {}
    exec(_CASES, scope)  # noqa: S102 - the same source the children run
    return scope["cases"]()


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """{march: the child's results}, both children compiled and run at once."""
    flags = _cpu_flags()
    marches = ["x86-64"] + (["x86-64-v3"] if {"avx2", "fma", "f16c"} <= flags else [])
    out = tmp_path_factory.mktemp("builds")
    procs = {m: subprocess.Popen([sys.executable, "-c", _CHILD, str(out / f"{m}.pt")], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env={**os.environ, "SPECDEC_MARCH": m})
             for m in marches}
    results = {}
    for m, proc in procs.items():
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"the {m} build failed: {err[-2000:]}"
        results[m] = torch.load(out / f"{m}.pt")
    return results


def _compare(here: dict[str, torch.Tensor], there: dict[str, torch.Tensor]) -> list[str]:
    assert here.keys() == there.keys()
    return [f"{name}: max |diff| {float((here[name] - there[name]).abs().max()):.3g}"
            for name in here if not torch.equal(here[name], there[name])]


def test_the_portable_build_gives_this_builds_bits(builds: dict[str, dict]) -> None:
    child = builds["x86-64"]
    assert child["isa"] == "portable"
    assert _compare(_here(), child["cases"]) == []
    assert child["q8_zero"] == 0  # no few-row int8 product: fbgemm runs every W8A8 product there


def test_the_avx2_build_gives_this_builds_bits(builds: dict[str, dict]) -> None:
    if "x86-64-v3" not in builds:
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    child = builds["x86-64-v3"]
    assert child["isa"] == "avx2"
    assert _compare(_here(), child["cases"]) == []
    assert child["q8_zero"] == 64 and child["q8_mismatches"] == []


def test_loading_a_built_library_imports_no_build_tools() -> None:
    """A process that finds the library already compiled for this machine loads it without
    importing ``torch.utils.cpp_extension``, which brings setuptools in (~0.25 s of every start-up
    on a 2-core machine).  This process built or found it, so the child finds it."""
    code = ("import sys\nfrom specdec.models import kernels\nassert kernels.load()\n"
            "print(sorted(m for m in ('torch.utils.cpp_extension', 'setuptools') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ.copy())
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_an_interrupted_compile_leaves_no_half_written_library(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM while the kernels compile: the compiler is stopped and its partial output
    removed (it stayed in the cache for ever, named by the process id)."""
    from pathlib import Path

    from specdec.models import kernels

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))

    def interrupted(cmd, **kwargs):
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"half a library")
        raise KeyboardInterrupt

    monkeypatch.setattr(kernels.subprocess, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        kernels._build("c++")
    assert sorted(p.suffix for p in (tmp_path / "kernels").iterdir()) == [".lock"]
